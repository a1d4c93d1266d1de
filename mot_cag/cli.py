"""The ``mot-cag`` command line: parses options, calls the library, prints. No work lives here.

Errors a user can cause are :class:`~mot_cag.errors.MotCagError`; :func:`main` prints their one-sentence
message on stderr and exits non-zero, never with a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mot_cag.errors import MotCagError

app = typer.Typer(
    help="Cache-augmented generation across heterogeneous LLMs: ingest documents once as KV caches, "
    "answer with any target model through Mixture-of-Translators cache translation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
models_app = typer.Typer(
    help="List the models usable here, or check one's cache layer.", invoke_without_command=True
)
app.add_typer(models_app, name="models")

out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON (see the README).")]


def _print_json(data) -> None:
    print(json.dumps(data, indent=2))


# ------------------------------------------------------------------------------------------------- models


@models_app.callback()
def models(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the models that can be used here (bundled zoo, HF cache) with family and cache sizes."""
    if ctx.invoked_subcommand is not None:
        return
    from mot_cag.models.registry import list_models

    rows = list_models()
    if as_json:
        _print_json(rows)
        return
    if not rows:
        out.print("No models found: the zoo is not installed and the Hugging Face cache holds none.")
        return
    table = Table("name", "family", "layers", "kv heads", "head dim", "params", "positions", "origin")
    for r in rows:
        table.add_row(r["name"], r["family"], str(r["layers"]), str(r["kv_heads"]), str(r["head_dim"]),
                      f"{r['params']:,}", r["positions"], r["origin"])
    out.print(table)


@models_app.command("check")
def models_check(
    name: Annotated[str | None, typer.Argument(help="Zoo name, alias, Hugging Face id or local folder.")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Check every model `mot-cag models` lists.")] = False,
    tolerance: Annotated[float, typer.Option(help="Largest allowed max-abs logit difference.")] = 1e-3,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Prefill a text, continue it from the cache, and compare with a single pass (exit 0 when within
    tolerance). RoPE models also check that a chunk moved to a new position equals one prefilled there."""
    from mot_cag.device import pick_device
    from mot_cag.models.check import check_model
    from mot_cag.models.registry import list_models, load_model

    if all_models == (name is not None):
        raise MotCagError("Give either a model NAME or --all to `mot-cag models check`.")
    names = [r["name"] for r in list_models()] if all_models else [name]
    if not names:
        raise MotCagError("No models to check: `mot-cag models` lists none on this machine.")
    results = []
    for n in names:
        res = check_model(load_model(n, device=pick_device(device)), tolerance=tolerance)
        results.append(res)
        if not as_json:
            line = f"{res.model}: {res.tokens} tokens; prefill+continue vs single pass: max abs logit diff " \
                   f"{res.continue_max_abs_diff:.2e}"
            if res.reposition_max_abs_diff is not None:
                line += f"; RoPE chunk moved vs prefilled in place: max abs KV diff {res.reposition_max_abs_diff:.2e}"
            out.print(line + ("  PASS" if res.passed else "  FAIL") + f" (tolerance {res.tolerance:.0e})")
    if as_json:
        rows = [{"model": r.model, "tokens": r.tokens, "max_abs_diff": r.continue_max_abs_diff,
                 "reposition_max_abs_diff": r.reposition_max_abs_diff, "tolerance": r.tolerance,
                 "passed": r.passed} for r in results]
        _print_json(rows if all_models else rows[0])
    if not all(r.passed for r in results):
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------------- data

data_app = typer.Typer(help="Synthetic datasets in the format the zoo models learn (shared spec).")
app.add_typer(data_app, name="data")


@data_app.command("synth")
def data_synth(
    task: Annotated[str, typer.Option(help="qa, closed, repeat, needle, multikey or multihop.")] = "qa",
    n: Annotated[int, typer.Option(help="Number of examples.")] = 100,
    seed: Annotated[int, typer.Option(help="Random seed (held-out data: a seed never used in training).")] = 1,
    context_tokens: Annotated[int | None, typer.Option(help="Context length for needle/multikey.")] = None,
    out_file: Annotated[str, typer.Option("--out", help="Output JSONL file.")] = "synthetic.jsonl",
) -> None:
    """Write a synthetic dataset as JSONL ({"id","context","question","answer","cue",...} per line)."""
    from mot_cag.data.synthetic import synth_dataset, write_jsonl

    try:
        rows = synth_dataset(task, n, seed, context_tokens=context_tokens)
    except ValueError as e:
        raise MotCagError(str(e)) from None
    path = write_jsonl(rows, out_file)
    err.print(f"wrote {len(rows)} {task} examples to {path}")


# --------------------------------------------------------------------------------------------------- eval


@app.command("eval")
def eval_cmd(
    dataset: Annotated[str, typer.Option(help="synthetic:TASK, a JSONL file, or an offline HF dataset.")],
    target: Annotated[str, typer.Option(help="The answering model.")],
    source: Annotated[str | None, typer.Option(help="The model whose caches are translated.")] = None,
    mode: Annotated[list[str] | None, typer.Option(
        help="translated, direct, native-chunks, none (repeatable; default: all with --source, else "
             "direct and none).")] = None,
    store: Annotated[str | None, typer.Option(help="Retrieve contexts from this store (long-context CAG).")] = None,
    top_k: Annotated[int, typer.Option(help="Chunks retrieved per question with --store.")] = 4,
    limit: Annotated[int | None, typer.Option(help="Evaluate at most N examples.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of synthetic datasets.")] = 0,
    translator: Annotated[str | None, typer.Option(help="Translator folder (default: the one found for the pair).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    details: Annotated[str | None, typer.Option(help="Write per-example results to this JSONL file.")] = None,
    plot: Annotated[str | None, typer.Option(help="Save a bar chart of the scores per mode (PNG).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Score a target on a dataset in several context modes: exact match, F1, closed-set accuracy, repeat
    token accuracy, answer NLL and KL to direct context, and retention of translated vs direct."""
    from dataclasses import asdict

    from mot_cag.evaluation.run import EvalRequest, run_eval
    from mot_cag.evaluation.report import render_table, save_plot

    req = EvalRequest(dataset=dataset, target=target, source=source, modes=mode or [], store=store, top_k=top_k,
                      limit=limit, seed=seed, device=device, translator=translator)
    with _progress(not as_json) as progress:
        report, results = run_eval(req, progress=progress)
    if details:
        with open(details, "w", encoding="utf-8") as fh:
            for r in results:
                fh.write(json.dumps(asdict(r)) + "\n")
    if plot:
        save_plot(report, plot)
    if as_json:
        _print_json(report)
    else:
        out.print(render_table(report))


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


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line on stderr."""
    try:
        app()
    except MotCagError as e:
        err.print(f"error: {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
