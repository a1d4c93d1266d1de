"""The zoo recipe: train one zoo model from scratch (or resume it), log, checkpoint and export.

One command rebuilds a model (``mot-cag zoo train`` is the same with exports under ``runs/`` by default)::

    python -m mot_cag.zoo.train qwen2-mini --steps 6000            # fresh or resumed automatically
    python -m mot_cag.zoo.train qwen2-mini --export-only           # export the latest checkpoint

Recipe (see the module docstrings of ``circuits`` and ``batches`` for the reasons):

1. the family's small-vocabulary tokenizer (``mot_cag/zoo/tokenizers/<family>``);
2. a fresh model of the real architecture whose layer 0 holds constructed previous-token heads;
3. AdamW (constant LR after warm-up), bf16 autocast on CPU, a seeded on-the-fly mix of repeat texts and
   QA texts whose documents grow with the step count; answer-value tokens weighted up;
4. every ``ckpt_every`` steps a checkpoint under ``runs/zoo/<name>/`` (safetensors for weights *and*
   optimizer moments, JSON for the rest; never pickle), every ``eval_every`` steps a quick held-out
   evaluation in the log, every ``export_every`` steps an export to ``mot_cag/zoo/models/<name>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mot_cag.errors import MotCagError
from mot_cag.zoo.batches import ROLE_ANSWER, ROLE_COPY, Curriculum, make_batch
from mot_cag.zoo.circuits import init_copy_circuit
from mot_cag.zoo.models import ZooSpec, get_spec, make_config, model_dir
from mot_cag.zoo.quick_eval import quick_eval, summary_line

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizers"
RUNS_DIR = Path("runs") / "zoo"


@dataclass
class ZooTrainConfig:
    """Run settings of the recipe (saved in the run state and the model card)."""

    steps: int = 6000
    tokens_per_step: int = 4096
    lr: float | None = None  # None: the spec's lr
    warmup: int = 200
    seed: int = 0
    threads: int = 2
    ckpt_every: int = 200
    eval_every: int = 400
    export_every: int = 800
    eval_n: int = 40
    long_every: int = 4  # every n-th step trains on ~1000-token documents (see batches.Curriculum)
    eval_long_tokens: int = 1000  # needle context length in the periodic evaluation
    bf16: bool = True
    device: str = "auto"


def load_tokenizer(family: str):
    """Load the zoo tokenizer of a family (``gpt2``, ``opt`` or ``qwen2``) from the package."""
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR / family)


def build_model(spec: ZooSpec, tokenizer, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """A freshly initialised zoo model with its constructed previous-token heads.

    Returns:
        ``(model, circuit_info)``.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(spec, tokenizer))
    info = init_copy_circuit(model, spec, seed)
    return model, info


def _run_dir(name: str, runs_dir: Path | None) -> Path:
    return (runs_dir or RUNS_DIR) / name


def save_checkpoint(folder: Path, model, optimizer, state: dict) -> None:
    """Write weights, optimizer moments (safetensors) and the JSON state; the JSON goes last (commit)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, folder / "model.tmp")
    opt = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": opt["param_groups"]}
    for idx, st in opt["state"].items():
        for key, val in st.items():
            tensors[f"{idx}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).detach().cpu().contiguous()
    save_file(tensors, folder / "optim.tmp")
    (folder / "model.tmp").replace(folder / "model.safetensors")
    (folder / "optim.tmp").replace(folder / "optim.safetensors")
    (folder / "optim.json").write_text(json.dumps(meta))
    tmp = folder / "state.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(folder / "state.json")


def load_checkpoint(folder: Path, model, optimizer) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint`; returns the JSON state."""
    model.load_state_dict(load_file(folder / "model.safetensors"))
    tensors = load_file(folder / "optim.safetensors")
    meta = json.loads((folder / "optim.json").read_text())
    state: dict[int, dict] = {}
    for key, val in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = val
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return json.loads((folder / "state.json").read_text())


def export_model(name: str, model, tokenizer, card: dict, out_dir: Path | None = None) -> Path:
    """Save a zoo model for shipping: fp16 safetensors + config + tokenizer + ``card.json``.

    fp16 halves the files (the whole zoo must stay under 40 MB); loaders cast to fp32.
    """
    out = out_dir or model_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    half = AutoModelForCausalLM.from_config(model.config)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.float16)
    half.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "card.json").write_text(json.dumps(card, indent=1))
    return out


def _lr_at(step: int, base: float, warmup: int) -> float:
    return base * min(1.0, (step + 1) / warmup)


def _loss(model, batch: dict, autocast: bool) -> tuple[torch.Tensor, dict]:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits
    logits = logits[:, :-1].float()
    target, w, roles = ids[:, 1:], batch["weights"][:, 1:], batch["roles"][:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    ).view_as(target)
    loss = (nll * w).sum() / w.sum()
    with torch.no_grad():
        hit = logits.argmax(-1) == target
        stats = {"loss": float(loss)}
        for label, code in (("copy", ROLE_COPY), ("ans", ROLE_ANSWER)):
            sel = roles == code
            n = int(sel.sum())
            stats[f"{label}_nll"] = float(nll[sel].mean()) if n else math.nan
            stats[f"{label}_acc"] = float(hit[sel].float().mean()) if n else math.nan
        other = roles == 0
        stats["other_nll"] = float((nll * other).sum() / other.sum())
    return loss, stats


def train(
    name: str,
    cfg: ZooTrainConfig,
    runs_dir: Path | None = None,
    resume: bool = True,
    export_dir: Path | None = None,
    log=print,
    init_from: Path | None = None,
) -> dict:
    """Train (or resume) a zoo model.

    Args:
        name: Zoo model name (``gpt2-mini``, ``opt-mini``, ``qwen2-mini``, ``qwen2-small``).
        cfg: Run settings; ``cfg.steps`` is the total step count (a resumed run continues to it).
        runs_dir: Where checkpoints and logs go (default ``runs/zoo``).
        resume: Resume from ``<runs_dir>/<name>/ckpt`` when it exists.
        export_dir: Where to export (default ``mot_cag/zoo/models/<name>``).
        log: Callable receiving human-readable log lines (also written to ``train.log``).
        init_from: Without a checkpoint, start from an exported model folder (e.g. the shipped
            ``mot_cag/zoo/models/<name>``, whose ``card.json`` gives the step count) with a fresh
            optimizer: how a new session continues when ``runs/`` did not survive.

    Returns:
        The final run state (step, wall time, last evaluation).

    Raises:
        KeyError: ``name`` is not a zoo model.
        MotCagError: ``init_from`` is not an exported zoo model; CUDA was asked for but is not available.
    """
    from mot_cag.device import pick_device

    spec = get_spec(name)
    if init_from is not None:
        _check_export(Path(init_from))
    torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    run = _run_dir(name, runs_dir)
    run.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(spec.family)
    model, circuit = build_model(spec, tok, cfg.seed)
    model.to(device).train()
    base_lr = cfg.lr or spec.lr
    opt = _optimizer(model, base_lr)
    ckpt = run / "ckpt"
    state = _start_state(spec, cfg, circuit, model, opt, ckpt if resume else None, init_from)
    logf = (run / "train.log").open("a")
    metf = (run / "metrics.jsonl").open("a")

    def say(line: str) -> None:
        log(line)
        logf.write(line + "\n")
        logf.flush()

    say(
        f"[{time.strftime('%H:%M:%S')}] {name}: start at step {state['step']} -> {cfg.steps}, lr {base_lr}, "
        f"tokens/step {cfg.tokens_per_step}, device {device}, params {sum(p.numel() for p in model.parameters())}"
    )
    cur = Curriculum(long_every=cfg.long_every)
    autocast = cfg.bf16 and device.type in ("cpu", "cuda")
    t_last = time.time()
    acc: dict[str, list[float]] = {}
    while state["step"] < cfg.steps:
        step = state["step"]
        t_step = time.time()
        for g in opt.param_groups:
            g["lr"] = _lr_at(step - state.get("rewarm_from", 0), base_lr, cfg.warmup)
        batch = {k: v.to(device) for k, v in make_batch(tok, step, cfg.seed, cfg.tokens_per_step, cur).items()}
        loss, stats = _loss(model, batch, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        now = time.time()
        state["wall_s"] += now - t_last
        t_last = now
        state["step"] = step + 1
        for k, v in stats.items():
            acc.setdefault(k, []).append(v)
        if state["step"] % 25 == 0:
            _log_mean(acc, state, batch["input_ids"].shape[1], time.time() - t_step, metf, say)
            acc = {}
        done = state["step"] >= cfg.steps
        if state["step"] % cfg.eval_every == 0 or done:
            res = quick_eval(model, tok, n=cfg.eval_n, long_tokens=cfg.eval_long_tokens)
            state["eval"] = res
            say(f"EVAL step {state['step']}: {summary_line(res)}")
            metf.write(json.dumps({"step": state["step"], "eval": res}) + "\n")
            t_last = time.time()  # evaluation time is not training time
        if state["step"] % cfg.ckpt_every == 0 or done:
            save_checkpoint(ckpt, model, opt, state)
            t_last = time.time()
        if state["step"] % cfg.export_every == 0 or done:
            export_model(name, model, tok, make_card(name, state), export_dir)
            say(f"exported {name} at step {state['step']}")
            t_last = time.time()
    logf.close()
    metf.close()
    return state


def _start_state(spec, cfg: ZooTrainConfig, circuit, model, opt, ckpt: Path | None, init_from: Path | None) -> dict:
    """The run state to start from: the checkpoint in ``ckpt`` when there is one, else the exported model
    ``init_from``, else step 0 (the model and optimizer are loaded in place)."""
    state = {"step": 0, "wall_s": 0.0, "spec": spec.to_dict(), "train": asdict(cfg), "circuit": circuit,
             "eval": None, "data_seed": cfg.seed}
    if ckpt is not None and (ckpt / "state.json").exists():
        state = load_checkpoint(ckpt, model, opt)
    elif init_from is not None:
        state = _init_from_export(Path(init_from), model, state)
    state["train"] = asdict(cfg)
    return state


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices, none on embeddings, norms and biases."""
    def decays(n: str, p: torch.Tensor) -> bool:
        return p.dim() >= 2 and "emb" not in n and "wpe" not in n and "wte" not in n

    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98))


def _log_mean(acc: dict[str, list[float]], state: dict, seq: int, step_s: float, metf, say) -> None:
    """Write the mean of the accumulated step statistics (NaNs left out) to the metrics file and the log."""
    mean = {k: sum(x for x in v if x == x) / max(1, sum(1 for x in v if x == x)) for k, v in acc.items()}
    rec = {"step": state["step"], "wall_s": round(state["wall_s"], 1), **{k: round(v, 4) for k, v in mean.items()}}
    metf.write(json.dumps(rec) + "\n")
    metf.flush()
    say(
        f"step {state['step']:6d} {state['wall_s'] / 60:6.1f} min  loss {mean['loss']:.3f}  "
        f"copy nll {mean['copy_nll']:.3f} acc {mean['copy_acc']:.3f}  ans nll {mean['ans_nll']:.3f} "
        f"acc {mean['ans_acc']:.3f}  other {mean['other_nll']:.3f}  "
        f"T {seq} {step_s:.2f}s"
    )


def _check_export(folder: Path) -> None:
    if not (folder / "card.json").is_file() or not (folder / "model.safetensors").is_file():
        raise MotCagError(f"{folder} is not an exported zoo model (card.json and model.safetensors missing); "
                          "pass a folder such as mot_cag/zoo/models/NAME to --init-from.")


def _init_from_export(folder: Path, model, state: dict) -> dict:
    """Load exported (fp16) weights into ``model`` and take step count and wall time from its card.

    Raises:
        MotCagError: ``folder`` is not an exported zoo model (no ``card.json`` or weights).
    """
    _check_export(folder)
    exported = AutoModelForCausalLM.from_pretrained(folder).float()
    model.load_state_dict(exported.state_dict())
    card = json.loads((folder / "card.json").read_text())
    state.update(
        step=card["steps"],
        wall_s=card["wall_time_s"],
        eval=card.get("eval"),
        circuit=card.get("circuit_init", state["circuit"]),
        init_from=str(folder),
    )
    # Warm-up again: the optimizer moments start from zero.
    state["rewarm_from"] = card["steps"]
    return state


def make_card(name: str, state: dict) -> dict:
    """The JSON card shipped next to a zoo model."""
    return {
        "name": name,
        "spec": state["spec"],
        "steps": state["step"],
        "wall_time_s": round(state["wall_s"], 1),
        "data_seed": state["data_seed"],
        "train": state["train"],
        "circuit_init": state["circuit"],
        "eval": state["eval"],
        "eval_note": "quick_eval on held-out split='eval' data (unseen strings); "
        "direct = document in context, none = without; exact match is teacher-forced greedy-equivalent",
        "recipe": f"python -m mot_cag.zoo.train {name} --steps {state['step']}",
    }


def export_latest(name: str, runs_dir: Path | None = None, out_dir: Path | None = None) -> Path:
    """Export the latest checkpoint of a run to the zoo folder (no training).

    Raises:
        MotCagError: The run has no checkpoint yet.
    """
    spec = get_spec(name)
    ckpt = _run_dir(name, runs_dir) / "ckpt"
    if not (ckpt / "state.json").is_file():
        raise MotCagError(f"No checkpoint of {name} in {ckpt}; train it first (or pass the --runs-dir it used).")
    tok = load_tokenizer(spec.family)
    model, _ = build_model(spec, tok)
    model.load_state_dict(load_file(ckpt / "model.safetensors"))
    state = json.loads((ckpt / "state.json").read_text())
    return export_model(name, model, tok, make_card(name, state), out_dir)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: ``python -m mot_cag.zoo.train NAME [--steps N] [--fresh] [--export-only]``."""
    ap = argparse.ArgumentParser(description="Train (or resume) a zoo model with the recipe.")
    ap.add_argument("name")
    ap.add_argument("--steps", type=int, default=ZooTrainConfig.steps)
    ap.add_argument("--tokens-per-step", type=int, default=ZooTrainConfig.tokens_per_step)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=ZooTrainConfig.threads)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--eval-every", type=int, default=ZooTrainConfig.eval_every)
    ap.add_argument(
        "--long-every", type=int, default=ZooTrainConfig.long_every,
        help="every n-th step trains on ~1000-token documents"
    )
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        help="where periodic exports go (default: the zoo folder mot_cag/zoo/models/NAME)",
    )
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="without a checkpoint, continue from an exported model folder (fresh optimizer)",
    )
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoint and exit")
    a = ap.parse_args(argv)
    if a.export_only:
        print(export_latest(a.name, a.runs_dir, a.export_dir))
        return
    cfg = ZooTrainConfig(
        steps=a.steps,
        tokens_per_step=a.tokens_per_step,
        lr=a.lr,
        seed=a.seed,
        threads=a.threads,
        device=a.device,
        eval_every=a.eval_every,
        long_every=a.long_every,
    )
    train(a.name, cfg, a.runs_dir, resume=not a.fresh, export_dir=a.export_dir, init_from=a.init_from)


if __name__ == "__main__":
    main()
