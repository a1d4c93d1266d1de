"""Translation vs the target's own prefill, timed on the real models' architectures without their weights.

Cost does not depend on weight values: this builds each target from its ``config.json`` with random weights
(so it runs where the converted models are not, e.g. a lent GPU machine), and times, in one run and on one
device, for contexts of N retrieved tokens made of chunks of C tokens:

* ``prefill``: the target prefilling the N context tokens itself (what direct mode pays at question time);
* ``direct``: translating the N/C chunks' source caches (random, of the source's layout) with the pair's
  translator (its saved config and weights) into every target layer: what the translated path pays instead;
* ``replay_joint``: the target re-running over the N tokens with the window substituted (the replay cost);

and reports milliseconds and the ratios to prefill. Alignment (tokenizer work, CPU) and the decode steps are
not included; ``bench_ask.py`` times whole questions with the real weights.

Usage::

    python benchmarks/bench_arch.py --models DIR_WITH_CONFIGS --translators DIR [--tokens 1024,2048,4096]
        [--chunk 256] [--dtype float32] [--device cuda] [--out results.json]

``--models`` holds one folder per model name with its ``config.json`` (``~/.cache/mot-cag/models`` works);
``--translators`` holds translator folders (``config.json`` + ``translator.safetensors``; a ``config.json`` alone
is timed with random weights of the same architecture).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(folder: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.to(device).eval()


def _alignment(t_tgt: int, t_src: int, device: torch.device) -> torch.Tensor:
    """A banded row-normalised alignment, as between two BPE tokenizations of one text."""
    rows = torch.arange(t_tgt, device=device).float() * (t_src / t_tgt)
    cols = torch.arange(t_src, device=device).float()
    w = ((cols[None, :] - rows[:, None]).abs() < max(1.0, t_src / t_tgt)).float()
    return w / w.sum(1, keepdim=True)


def _measure(tr, model, n: int, chunk: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Median times of one translator and context length (see the module docstring)."""
    from mot_cag.models.cache import KVChunk, prefill, replay_forward
    from mot_cag.translate.inject import translate, window_substitutes

    src = tr.config.src
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(n)
    k = max(1, n // chunk)
    per = n // k  # target tokens per chunk
    ids = torch.randint(100, vocab - 100, (k * per,), generator=g).to(device)
    chunks = [KVChunk(*torch.randn(2, src.layers, src.kv_heads, chunk, src.head_dim, generator=g)
                      .to(device=device, dtype=dtype).unbind(0), 0) for _ in range(k)]
    W = _alignment(per, chunk, device).to(dtype)

    def direct():
        for i, c in enumerate(chunks):
            translate(tr, c, W, model, ids[i * per:(i + 1) * per], target_start=i * per, injection="inject-all")

    with torch.no_grad():
        t_prefill = _time(lambda: prefill(model, ids), device, repeats)
        t_direct = _time(direct, device, repeats)
        subs = window_substitutes(tr, translate(tr, chunks[0], W, model, ids[:per], injection="inject-all"))
        full = {layer: (kv[0].repeat(1, k, 1), kv[1].repeat(1, k, 1)) for layer, kv in subs.items()}
        t_replay = _time(lambda: replay_forward(model, ids, full, need_logits=False), device, repeats)
    return {"tokens": k * per, "prefill_ms": 1e3 * t_prefill, "direct_ms": 1e3 * t_direct,
            "replay_joint_ms": 1e3 * t_replay, "direct_vs_prefill": t_direct / t_prefill,
            "replay_vs_prefill": t_replay / t_prefill}


def bench(models: Path, translators: Path, tokens: list[int], chunk: int, dtype: torch.dtype,
          device: torch.device, repeats: int) -> list[dict]:
    """One row per (translator, context length), targets built once each."""
    from mot_cag.translate.checkpoint import load_translator, read_config
    from mot_cag.translate.mot import Translator

    rows = []
    by_target: dict[str, list[Path]] = {}
    for cfg in sorted(translators.glob("*/config.json")):
        by_target.setdefault(json.loads(cfg.read_text())["target"], []).append(cfg.parent)
    for target, folders in by_target.items():
        model = _model(models / target, dtype, device)
        for folder in folders:
            if (folder / "translator.safetensors").is_file():
                tr = load_translator(folder, device=device).to(dtype)
            else:  # a config alone: the same architecture with random weights costs the same
                tr = Translator(read_config(folder)).to(device=device, dtype=dtype).eval()
            for n in tokens:
                row = {"source": tr.config.source, "target": target, "translator": folder.name,
                       "kind": tr.config.kind, "params": tr.parameter_count(), "chunk": chunk,
                       "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                       **_measure(tr, model, n, chunk, device, dtype, repeats)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True)
    ap.add_argument("--translators", required=True)
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from mot_cag.device import pick_device

    device = torch.device(pick_device(args.device))
    rows = bench(Path(args.models).expanduser(), Path(args.translators).expanduser(),
                 [int(x) for x in args.tokens.split(",")], args.chunk, getattr(torch, args.dtype), device,
                 args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{device}, {args.dtype}, chunks of {args.chunk} tokens\n")
    print("| source | target | tokens | prefill ms | direct ms | direct/prefill | replay-joint/prefill |")
    for r in rows:
        print(f"| {r['source']} | {r['target']} | {r['tokens']} | {r['prefill_ms']:.1f} | {r['direct_ms']:.1f} | "
              f"{r['direct_vs_prefill']:.3f} | {r['replay_vs_prefill']:.2f} |")


if __name__ == "__main__":
    main()
