"""`mot-cag eval`, `mot-cag translators`, `mot-cag train`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mot_cag.cli import (
    MODE_CHOICES,
    InjectionOpt,
    JsonOpt,
    RecomputeOpt,
    RecomputePolicyOpt,
    WindowOpt,
    _choices,
    _print_json,
    _table,
    app,
    err,
    out,
)
from mot_cag.errors import MotCagError
from mot_cag.names import CHUNK_PREFIXES, COVERAGES, DEFAULT_RECOMPUTE_POLICY, choose

# --------------------------------------------------------------------------------------------------- eval


@app.command("eval")
def eval_cmd(
    dataset: Annotated[str, typer.Option(help="synthetic:TASK, a JSONL file, or an offline HF dataset.")],
    target: Annotated[str, typer.Option(help="The answering model.")],
    source: Annotated[str | None, typer.Option(help="The model whose caches are translated.")] = None,
    mode: Annotated[list[str] | None, typer.Option(
        metavar=MODE_CHOICES,
        help="Context modes (repeatable; default: all with --source, else direct and none).")] = None,
    store: Annotated[str | None, typer.Option(help="Retrieve contexts from this store (long-context CAG).")] = None,
    top_k: Annotated[int, typer.Option(help="Chunks retrieved per question with --store.")] = 4,
    limit: Annotated[int | None, typer.Option(help="Evaluate at most N examples.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of synthetic datasets.")] = 0,
    translator: Annotated[str | None, typer.Option(help="Translator folder (default: found for the pair).")] = None,
    injection: InjectionOpt = "auto",
    replay_window: WindowOpt = "auto",
    recompute: RecomputeOpt = "auto",
    recompute_policy: RecomputePolicyOpt = DEFAULT_RECOMPUTE_POLICY,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    details: Annotated[str | None, typer.Option(help="Write per-example results to this JSONL file.")] = None,
    plot: Annotated[str | None, typer.Option(help="Save a bar chart of the scores per mode (PNG).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Score a target on a dataset in several context modes: exact match, F1, closed-set accuracy, repeat
    token accuracy, answer NLL and KL to direct context, and retention of translated vs direct."""
    from dataclasses import asdict

    from mot_cag.config import parse_window
    from mot_cag.evaluation.report import check_plot, render_table, save_plot
    from mot_cag.evaluation.run import EvalRequest, run_eval

    if plot:
        check_plot(plot)  # before the evaluation, not after it

    req = EvalRequest(dataset=dataset, target=target, source=source, modes=mode or [], store=store, top_k=top_k,
                      limit=limit, seed=seed, device=device, translator=translator, injection=injection or "auto",
                      recompute=recompute or "auto", recompute_policy=recompute_policy or DEFAULT_RECOMPUTE_POLICY,
                      replay_window=parse_window(replay_window))
    with _progress(not as_json) as progress:
        report, results = run_eval(req, progress=progress)
    if details:
        with open(details, "w", encoding="utf-8") as fh:
            for r in results:
                fh.write(json.dumps(asdict(r)) + "\n")
    if as_json:
        _print_json(report)
    else:
        out.print(render_table(report))
    if plot:  # after the results are printed: a failing plot loses nothing
        try:
            save_plot(report, plot)
        except (OSError, ValueError, RuntimeError) as e:
            raise MotCagError(f"The plot could not be saved to {plot} ({e}); the results are above.") from None


def _progress(enabled: bool):
    """A rich progress bar on stderr; yields ``(total, done) -> advance(n)``."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    @contextmanager
    def ctx():
        if not enabled or not err.is_terminal:
            yield None
            return
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as prog:
            def start(total: int, done: int = 0):
                task = prog.add_task("examples", total=total, completed=done)
                return lambda n=1: prog.advance(task, n)

            yield start

    return ctx()


# ---------------------------------------------------------------------------------------------- translators


@app.command("translators")
def translators_cmd(as_json: JsonOpt = False) -> None:
    """List the translators available here (user directory first, then the bundled zoo)."""
    from mot_cag.translate.checkpoint import list_translators, search_dirs

    rows = list_translators()
    if as_json:
        _print_json(rows)
        return
    if not rows:
        out.print("No translators found in " + ", ".join(str(d) for d in search_dirs())
                  + "; train one with `mot-cag train --source S --target T`.")
        return
    table = _table("source", "target", "kind", "coverage", "experts", "params", "path")
    for r in rows:
        table.add_row(r["source"], r["target"], r["kind"], r["coverage"], str(r["experts"]), f"{r['params']:,}",
                      r["path"])
    out.print(table)


@app.command("train")
def train_cmd(
    source: Annotated[str, typer.Option(help="Model whose caches are translated.")],
    target: Annotated[str, typer.Option(help="Model that reads the translated caches.")],
    data: Annotated[str, typer.Option(
        help="synthetic (the zoo's task), documents (corpus-like fact documents), prose (texts shipped in installed "
             "packages), real (documents + prose), a JSONL dataset, or a text file.")] = "synthetic",
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 300,
    experts: Annotated[int, typer.Option(help="Experts K per mixture.")] = 4,
    top_k: Annotated[int, typer.Option("--top-k", help="Experts mixed per token.")] = 2,
    out_dir: Annotated[str | None, typer.Option("--out", help="Output folder (default: user translator dir).")] = None,
    kind: Annotated[str, typer.Option(metavar=_choices(("mot", "single", "ridge")),
                                      help="mot, single (K=1) or ridge (closed form, no training).")] = "mot",
    injection: Annotated[str, typer.Option(
        metavar=_choices(COVERAGES),
        help="What the translator covers: inject-all (every layer; can also replay) or replay (the window).")
    ] = "inject-all",
    old_mode: Annotated[str | None, typer.Option("--mode", hidden=True,
                                                 help="Old name of --injection (direct = inject-all).")] = None,
    expert: Annotated[str, typer.Option(metavar=_choices(("attn", "mlp")),
                                        help="Expert kind: attn (paper) or mlp (light).")] = "attn",
    hidden: Annotated[int, typer.Option(help="Expert hidden width.")] = 128,
    window_start: Annotated[int | None, typer.Option(help="First injected target layer (replay).")] = None,
    window_width: Annotated[int | None, typer.Option(help="Injected layers (replay).")] = None,
    token_features: Annotated[bool, typer.Option(
        "--token-features", help="Feed the target's token embeddings to the experts (inject-all).")] = False,
    prev_token: Annotated[int, typer.Option("--prev-token", "--prev-tokens",
                                            help="Previous tokens whose features the experts also read.")] = 0,
    token_rank: Annotated[int, typer.Option(
        help="With --token-features: project the embeddings onto this many principal directions (0 = full "
             "width; a smaller translator file).")] = 0,
    batch: Annotated[int, typer.Option(help="Examples per step.")] = 4,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 2e-3,
    ce: Annotated[float, typer.Option(help="Weight of the prompt-LM cross-entropy (paper: 1).")] = 0.0,
    ccl: Annotated[float, typer.Option(help="Weight of the Context Correction Loss.")] = 1.0,
    kl: Annotated[float, typer.Option(help="Weight of KL to the native target (paper: 0).")] = 5.0,
    init: Annotated[str, typer.Option(metavar=_choices(("ridge", "identity")),
                                      help="ridge (closed-form start) or identity.")] = "ridge",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    eval_examples: Annotated[int, typer.Option("--eval", help="Held-out pairs scored after training.")] = 16,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    half: Annotated[bool, typer.Option("--half", help="Store the weights as float16 (half the size).")] = False,
    chunk_prefix: Annotated[str, typer.Option(
        metavar=_choices(CHUNK_PREFIXES),
        help="auto, prompt or none: train on chunks prefilled after each model's prompt head, as prefixed stores "
             "hold them (auto: when both models make prefixed stores).")] = "auto",
    calibration_tokens: Annotated[int, typer.Option(help="Tokens that fit normalisation (and the ridge).")] = 4096,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Discard the saved state of an interrupted run into the same folder and start over "
                        "(by default a rerun with the same settings continues where it stopped).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Train a Mixture-of-Translators for (source, target) and save it where `mot-cag translators` finds it.

    A run keeps its state in <out>.partial every 10 steps and when interrupted (Ctrl-C); rerunning the same
    command continues from there."""
    from mot_cag.translate.recipe import TrainRequest, run_training
    from mot_cag.translate.spec import TranslatorSpec
    from mot_cag.translate.train import TrainConfig

    try:
        cfg = TrainConfig(steps=steps, batch=batch, lr=lr, ce=ce, ccl=ccl, kl=kl, init=init, seed=seed, data=data,
                          chunk_prefix=chunk_prefix, calibration_tokens=calibration_tokens)
        spec = TranslatorSpec(kind=kind, coverage=choose("injection", old_mode or injection, COVERAGES),
                              expert=expert, experts=experts, top_k=top_k, hidden=hidden, window_start=window_start,
                              window_width=window_width, token_features=token_features, prev_token=prev_token,
                              token_rank=token_rank)
    except ValueError as e:
        raise MotCagError(str(e)) from None
    req = TrainRequest(source=source, target=target, spec=spec, train=cfg, out=out_dir,
                       eval_examples=eval_examples, device=device, half=half, fresh=fresh)

    def log(r: dict) -> None:  # progress goes to stderr, so --json output on stdout stays clean
        if "resumed_from" in r:
            err.print(f"resuming an interrupted run after step {r['resumed_from']} (--fresh starts over)",
                      highlight=False)
            return
        err.print(f"step {r['step']}: loss {r['loss']:.4f} (ce {r['ce']:.4f}, ccl {r['ccl']:.4f}, "
                  f"kl {r['kl']:.5f}) lr {r['lr']:.2e} {r['seconds']}s", highlight=False)

    result = run_training(req, log=log)
    if as_json:
        _print_json(result)
        return
    out.print(f"saved {result['kind']} translator {source} -> {target} ({result['params']:,} params) to "
              f"{result['path']} in {result['seconds']}s")
    for m, ev in result.get("eval", {}).items():
        def fmt(v):
            return "n/a" if v is None else f"{v:.4f}"

        out.print(f"held-out {m}: kl_benefit {fmt(ev['kl_benefit'])}, nll_benefit {fmt(ev['nll_benefit'])}, "
                  f"top-1 agreement {fmt(ev['top1_agreement'])} (n={ev['n']})")
