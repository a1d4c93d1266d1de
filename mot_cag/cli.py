"""The ``mot-cag`` command line: parses options, calls the library, prints. No work lives here.

Errors a user can cause are :class:`~mot_cag.errors.MotCagError`; :func:`main` prints their one-sentence
message on stderr and exits non-zero, never with a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mot_cag.config import CHUNK_PREFIXES, INJECTIONS, MODES, RECOMPUTE_POLICIES
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

def _console(stderr: bool = False) -> Console:
    """Rich formatting on a terminal; piped or redirected, plain lines that are never wrapped or cut."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, soft_wrap=True, width=10_000, no_color=True, highlight=False)


out = _console()
err = _console(stderr=True)


def _table(*columns: str) -> Table:
    """A table: boxed on a terminal, plain space-separated columns when piped."""
    if out.is_terminal:
        return Table(*columns)
    return Table(*columns, box=None, show_edge=False, pad_edge=False, header_style="")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON (see the README).")]


def _choices(values) -> str:
    """A metavar that shows an option's choices in --help."""
    return "[" + "|".join(values) + "]"


def _pipeline_default(key: str) -> str:
    """The default pipeline's value of ``key``, for --help ("default: the pipeline's, now X")."""
    from mot_cag.config import PipelineConfig

    try:
        value = getattr(PipelineConfig.from_file(None), key)
    except MotCagError:
        value = getattr(PipelineConfig(), key)
    return f"default: the pipeline's, now {value}"


MODE_CHOICES = _choices(MODES)
RecomputeOpt = Annotated[str | None, typer.Option(
    metavar="[auto|0-1]",
    help="Cross-chunk repair: fraction of context tokens (0-1) whose K/V are recomputed against the whole "
         "context (CacheBlend-style; native-chunks and translated modes). 0 = off; auto (default) = the measured "
         "default, now 0 (docs/chunk-caches.md: 0.1 brought KL closer to direct but not the answers).")]
RecomputePolicyOpt = Annotated[str | None, typer.Option(
    metavar=_choices(RECOMPUTE_POLICIES),
    help="Which tokens --recompute picks: deviation (largest layer-1 K/V deviation from a partial single pass), "
         "start (first tokens of each chunk) or spread (evenly spaced); " + _pipeline_default("recompute_policy")
         + ".")]
InjectionOpt = Annotated[str | None, typer.Option(
    metavar=_choices(INJECTIONS),
    help="How translated caches enter the target: auto (= replay-joint), direct (translated K/V are the cache; "
         "fastest), replay (the target re-runs each chunk with translated K/V in its window layers) or "
         "replay-joint (one such re-run over all retrieved chunks, with cross-chunk attention); "
         + _pipeline_default("injection") + ".")]
WindowOpt = Annotated[str | None, typer.Option(
    metavar="[auto|0-1]",
    help="replay-joint: share of the target's layers, from the top, that take translated K/V (0-1]; the target "
         "computes the layers below itself, about (1 - share) of a prefill. auto = the translator's own window.")]


def _version(value: bool) -> None:
    if value:
        from mot_cag import __version__

        print(f"mot-cag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Cache-augmented generation across heterogeneous LLMs: ingest documents once as KV caches, answer with
    any target model through Mixture-of-Translators cache translation."""


def _print_json(data) -> None:
    print(json.dumps(data, indent=2))


# ------------------------------------------------------------------------------------------------- models


@models_app.callback()
def models(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the models that can be used here (bundled zoo, real models from installed packages, HF cache) with
    family and cache sizes; real models not installed are listed with the pip command that installs them."""
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
    table = _table("name", "family", "layers", "kv heads", "head dim", "params", "positions", "origin")
    notes = []
    for r in rows:
        if r["family"] is None:  # a packaged real model not converted yet (or not installed)
            state = "installed, converted on first use" if r["origin"] == "package" else f"install: {r['install']}"
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["origin"])
            notes.append(f"{r['name']}: {state}")
            continue
        table.add_row(r["name"], r["family"], str(r["layers"]), str(r["kv_heads"]), str(r["head_dim"]),
                      f"{r['params']:,}", r["positions"], r["origin"])
    out.print(table)
    for note in notes:
        out.print(note, highlight=False, soft_wrap=True)


@models_app.command("prepare")
def models_prepare(
    names: Annotated[list[str] | None, typer.Argument(help="Real model names (smollm2-135m, qwen2.5-coder-0.5b, "
                                                           "gemma-3-270m) or aliases.")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Every real model whose packages are installed.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Convert again even when a converted folder exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert real models from their installed packages' GGUF into safetensors folders in the user's cache
    ($MOT_CAG_HOME or ~/.cache/mot-cag/models), ahead of first use. Safe to interrupt: nothing half-made stays."""
    from mot_cag.models import packaged

    if all_models == bool(names):
        raise MotCagError("Give model NAMEs or --all to `mot-cag models prepare`.")
    if all_models:
        chosen = [m for m in packaged.PACKAGED.values() if packaged.installed(m)]
        if not chosen:
            raise MotCagError("No real-model packages are installed; see `mot-cag models` for the pip commands.")
    else:
        chosen = []
        for n in names or []:
            m = packaged.lookup(n)
            if m is None:
                raise MotCagError(f"'{n}' is not a packaged real model; choose from {', '.join(packaged.PACKAGED)}.")
            chosen.append(m)
    packaged.clean_partial()
    done = []
    for m in chosen:
        t0 = time.perf_counter()
        was = packaged.is_converted(m) and not force
        path = packaged.convert(m, packaged.StderrProgress(m.name), force=force)
        secs = time.perf_counter() - t0
        done.append({"name": m.name, "path": str(path), "converted": not was, "seconds": round(secs, 1)})
        if not as_json:
            what = "already converted" if was else f"converted in {secs:.0f} s"
            out.print(f"{m.name}: {what} -> {path}", highlight=False, soft_wrap=True)
    if as_json:
        _print_json(done)


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


@data_app.command("corpus")
def data_corpus(
    folder: Annotated[str, typer.Argument(help="Corpus folder: DIR/docs/doc-XXX.txt and DIR/questions.jsonl.")],
    docs: Annotated[int, typer.Option(help="Number of documents.")] = 40,
    questions: Annotated[int, typer.Option(help="Number of questions, spread over the documents.")] = 60,
    seed: Annotated[int, typer.Option(help="Random seed (the same seed writes identical files).")] = 7311,
    facts_per_doc: Annotated[str, typer.Option(help="Fact sentences per document: MIN-MAX or N.")] = "10-14",
    tokenizer: Annotated[str, typer.Option(help="Model whose tokenizer measures the documents.")] = "qwen2-mini",
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty DIR/docs (deletes its files).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a held-out corpus for long-context CAG: documents of facts about corpus-unique people (eval split
    names and values) and questions naming the document that answers each. Ingest DIR/docs, then
    `mot-cag eval --dataset DIR/questions.jsonl --store ...`."""
    from mot_cag.data.corpus import CorpusConfig, make_corpus, parse_facts_range, write_corpus
    from mot_cag.models.registry import load_model

    lo, hi = parse_facts_range(facts_per_doc)
    cfg = CorpusConfig(docs=docs, questions=questions, seed=seed, facts_min=lo, facts_max=hi)
    tok = load_model(tokenizer, weights=False).tokenizer  # before writing: a missing model writes nothing
    s = write_corpus(make_corpus(cfg), folder, force=force, tokenizer=tok, tokenizer_name=tokenizer)
    if as_json:
        _print_json(s.to_json())
        return
    dt = s.doc_tokens or {}
    out.print(f"wrote {s.docs} documents and {s.questions} questions to {s.dir} (seed {s.seed}): {s.tokens:,} "
              f"{tokenizer} tokens, {dt.get('min')}-{dt.get('max')} per document (mean {dt.get('mean')}).",
              highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------------- zoo

zoo_app = typer.Typer(help="Rebuild the bundled zoo models with their recipe, and measure them.",
                      no_args_is_help=True)
app.add_typer(zoo_app, name="zoo")


def _zoo_spec(name: str):
    """The zoo spec of ``name``, or a user error listing the zoo."""
    from mot_cag.zoo.models import get_spec

    try:
        return get_spec(name)
    except KeyError as e:
        raise MotCagError(e.args[0]) from None


@zoo_app.command("train")
def zoo_train(
    name: Annotated[str, typer.Argument(help="Zoo model: gpt2-mini, opt-mini, qwen2-mini or qwen2-small.")],
    steps: Annotated[int | None, typer.Option(help="Total steps; a resumed run continues to it (6000).")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads (default 2).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    long_every: Annotated[int | None, typer.Option(help="Every n-th step trains on ~1000-token documents (4).")] = None,
    tokens_per_step: Annotated[int | None, typer.Option(help="Tokens per optimizer step (4096).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (default: the model spec's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and of the data stream.")] = 0,
    eval_every: Annotated[int | None, typer.Option(help="Steps between held-out evaluations in the log (400).")] = None,
    eval_n: Annotated[int | None, typer.Option(help="Examples per task in those evaluations (40).")] = None,
    ckpt_every: Annotated[int | None, typer.Option(help="Steps between checkpoints (200).")] = None,
    export_every: Annotated[int | None, typer.Option(help="Steps between exports (800).")] = None,
    runs_dir: Annotated[str | None, typer.Option(help="Checkpoints and logs go to RUNS_DIR/NAME (runs/zoo).")] = None,
    export_dir: Annotated[str | None, typer.Option(
        help="Where exports go (default RUNS_DIR/NAME/export; with --export-only the shipped zoo folder).")] = None,
    init_from: Annotated[str | None, typer.Option(
        help="Without a checkpoint, continue from an exported model folder (fresh optimizer).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start from step 0, ignoring an existing checkpoint.")] = False,
    export_only: Annotated[bool, typer.Option(
        "--export-only", help="Export the latest checkpoint (no training) and exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Train a zoo model from scratch with its recipe (seeded; CPU or CUDA), resuming from its last checkpoint.

    Exports go to RUNS_DIR/NAME/export unless --export-dir says otherwise, so the shipped weights (which the
    bundled translators were trained against) change only when `--export-only` promotes a checkpoint."""
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from mot_cag.zoo.models import model_dir
    from mot_cag.zoo.train import RUNS_DIR, TrainConfig, export_latest, train

    _zoo_spec(name)
    hf_logging.disable_progress_bar()
    runs = Path(runs_dir) if runs_dir else RUNS_DIR
    if export_only:
        path = export_latest(name, runs, Path(export_dir) if export_dir else model_dir(name))
        if as_json:
            _print_json({"name": name, "export_dir": str(path)})
        else:
            out.print(f"exported the latest {name} checkpoint to {path}", highlight=False, soft_wrap=True)
        return
    given = {"steps": steps, "threads": threads, "long_every": long_every, "tokens_per_step": tokens_per_step,
             "lr": lr, "eval_every": eval_every, "eval_n": eval_n, "ckpt_every": ckpt_every,
             "export_every": export_every}
    for key, v in given.items():
        if v is not None and v <= 0:
            raise MotCagError(f"--{key.replace('_', '-')} must be positive, got {v}.")
    cfg = TrainConfig(seed=seed, device=device, **{k: v for k, v in given.items() if v is not None})
    export = Path(export_dir) if export_dir else runs / name / "export"
    state = train(name, cfg, runs, resume=not fresh, export_dir=export,
                  log=lambda line: err.print(line, highlight=False, markup=False, soft_wrap=True),
                  init_from=Path(init_from) if init_from else None)
    if as_json:
        _print_json({"name": name, "step": state["step"], "wall_s": round(state["wall_s"], 1),
                     "run_dir": str(runs / name), "export_dir": str(export), "eval": state["eval"]})
        return
    out.print(f"{name}: step {state['step']} after {state['wall_s'] / 60:.1f} min of training; checkpoint in "
              f"{runs / name / 'ckpt'}, exported to {export}", highlight=False, soft_wrap=True)


@zoo_app.command("eval")
def zoo_eval(
    models: Annotated[list[str] | None, typer.Argument(
        help="Zoo names or exported model folders (default: every shipped zoo model).")] = None,
    n: Annotated[int, typer.Option(help="Examples per task.")] = 100,
    seed: Annotated[int, typer.Option(help="Data seed (held-out strings either way).")] = 9001,
    long_tokens: Annotated[int, typer.Option(help="Context of needle and multi-key (0: skip).")] = 1000,
    threads: Annotated[int, typer.Option(help="CPU threads.")] = 2,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Quick held-out evaluation of zoo models, one table row per model (the columns of zoo/EVAL.md).

    Each cell is with the document / without it (direct / none): repeat token accuracy, QA exact match and
    NLL, closed-set accuracy, needle and multi-key exact match."""
    import torch
    from transformers.utils import logging as hf_logging

    from mot_cag.device import pick_device
    from mot_cag.zoo.models import ZOO, model_dir
    from mot_cag.zoo.quick_eval import eval_folder, eval_models, summary_line, table

    if n < 1 or threads < 1 or long_tokens < 0:
        raise MotCagError("--n and --threads must be positive and --long-tokens at least 0.")
    names = models or [z for z in ZOO if (model_dir(z) / "config.json").is_file()]
    for name in names:  # fail before minutes of evaluation, not after
        eval_folder(name)
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    results = eval_models(names, n=n, seed=seed, long_tokens=long_tokens or None, device=pick_device(device),
                          on_result=lambda name, res: err.print(f"{name}: {summary_line(res)}", highlight=False,
                                                                soft_wrap=True))
    if as_json:
        _print_json(results)
    else:
        out.print(table(results), highlight=False, markup=False, soft_wrap=True)


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
    recompute_policy: RecomputePolicyOpt = "deviation",
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
                      recompute=recompute or "auto", recompute_policy=recompute_policy or "deviation",
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
    table = _table("source", "target", "kind", "mode", "experts", "params", "path")
    for r in rows:
        table.add_row(r["source"], r["target"], r["kind"], r["mode"], str(r["experts"]), f"{r['params']:,}",
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
    mode: Annotated[str, typer.Option(metavar=_choices(("direct", "replay")),
                                      help="Injection: direct (every layer) or replay (window).")] = "direct",
    expert: Annotated[str, typer.Option(metavar=_choices(("attn", "mlp")),
                                        help="Expert kind: attn (paper) or mlp (light).")] = "attn",
    hidden: Annotated[int, typer.Option(help="Expert hidden width.")] = 128,
    window_start: Annotated[int | None, typer.Option(help="First injected target layer (replay).")] = None,
    window_width: Annotated[int | None, typer.Option(help="Injected layers (replay).")] = None,
    token_features: Annotated[bool, typer.Option(
        "--token-features", help="Feed the target's token embeddings to the experts (direct injection).")] = False,
    prev_tokens: Annotated[int, typer.Option(help="Previous tokens whose features the experts also read.")] = 0,
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
    as_json: JsonOpt = False,
) -> None:
    """Train a Mixture-of-Translators for (source, target) and save it where `mot-cag translators` finds it."""
    from mot_cag.translate.train import TrainConfig, TrainRequest, run_training

    try:
        cfg = TrainConfig(steps=steps, batch=batch, lr=lr, ce=ce, ccl=ccl, kl=kl, init=init, seed=seed, data=data,
                          chunk_prefix=chunk_prefix, calibration_tokens=calibration_tokens)
    except ValueError as e:
        raise MotCagError(str(e)) from None
    req = TrainRequest(source=source, target=target, out=out_dir, kind=kind, mode=mode, expert=expert,
                       experts=experts, top_k=top_k, hidden=hidden, window_start=window_start,
                       window_width=window_width, token_features=token_features, prev_token=prev_tokens,
                       token_rank=token_rank,
                       eval_examples=eval_examples, device=device, half=half, train=cfg)

    def log(r: dict) -> None:  # progress goes to stderr, so --json output on stdout stays clean
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


# ------------------------------------------------------------------------------------------- ingest / store

StoreOpt = Annotated[str | None, typer.Option(
    "--store", help="Store folder (default: the pipeline's store; MOT_CAG_STORE overrides it).")]


def _store_path(store: str | None) -> str:
    """``--store`` or, when absent, the default pipeline's store (with the environment's overrides)."""
    if store:
        return store
    from mot_cag.config import PipelineConfig

    return str(PipelineConfig.from_file(None).store)


@app.command("ingest")
def ingest_cmd(
    paths: Annotated[list[str], typer.Argument(
        help="Files or folders of UTF-8 text (any name: .txt, .md, .rst, LICENSE...; folders are read "
             "recursively).")],
    store: Annotated[str | None, typer.Option("--store", help="Store folder (default from the pipeline).")] = None,
    source: Annotated[str | None, typer.Option(
        help="Source model (default: the store's, else the pipeline's).")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(
        help="Chunk size in source tokens (default: the store's, else the pipeline's).")] = None,
    dtype: Annotated[str | None, typer.Option(
        metavar=_choices(("float16", "bfloat16", "float32")),
        help="KV dtype of a new store (" + _pipeline_default("kv_dtype") + ").")] = None,
    embedder: Annotated[str | None, typer.Option(
        help="Embedder of a new store: all-MiniLM-L6-v2, hash, or a sentence-transformers folder (default from the "
             "pipeline).")] = None,
    chunk_prefix: Annotated[str | None, typer.Option(
        metavar=_choices(CHUNK_PREFIXES),
        help="What a new store's chunks are prefilled after: prompt (the source's prompt head, so chunks look as "
             "they are read), none (each alone), auto (prompt for real RoPE models, none for the zoo); default "
             "from the pipeline.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, or auto (default from the pipeline).")] = None,
    wait: Annotated[float | None, typer.Option(
        help="Seconds to wait for another ingest writing the store (default: as long as it takes).")] = None,
    pipeline: Annotated[str | None, typer.Option(
        "--pipeline", help="Pipeline TOML (default pipelines/default.toml): store; a new store's settings.")] = None,
    sync: Annotated[bool, typer.Option(
        "--sync/--no-sync", help="Remove the store's documents under each given folder that are no longer there "
                                 "(deleted or moved away), with the chunks only they used.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Prefill documents once with the source model and keep their KV caches, embedded and indexed.
    Idempotent and resumable: unchanged files add nothing; an interrupted run continues where it stopped;
    re-ingesting a folder forgets files deleted from it (--no-sync keeps them).
    A new store takes its source, chunking, dtype and embedder from the options, else the pipeline; an existing
    store keeps its own."""
    from mot_cag.config import PipelineConfig
    from mot_cag.device import pick_device
    from mot_cag.ingest import ingest
    from mot_cag.store.progress import RichIngestProgress

    cfg = PipelineConfig.from_file(pipeline)
    with RichIngestProgress(err) as bar:
        res = ingest(paths, store or cfg.store, source, chunk_tokens=chunk_tokens, dtype=dtype, embedder=embedder,
                     device=pick_device(device or cfg.device), lock_timeout=wait, progress=bar, pipeline=cfg,
                     chunk_prefix=chunk_prefix, sync=sync)
    if as_json:
        _print_json(res.to_json())
        return
    out.print(f"{res.documents} documents in {res.store} ({res.documents_unchanged} unchanged): "
              f"{res.chunks_added} chunks added, {res.chunks_skipped} already stored, {res.chunks_removed} removed; "
              + (f"{res.documents_removed} documents no longer there removed; " if res.documents_removed else "")
              + f"{res.tokens:,} tokens in {res.seconds:.1f} s; source {res.source}.", highlight=False)


store_app = typer.Typer(help="Inspect, check and manage a KV store.", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("info")
def store_info(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Documents, chunks, tokens, bytes and source model of a store."""
    from mot_cag.store.store import Store

    with Store.open(_store_path(store)) as st:
        info = st.info()
    if as_json:
        _print_json(info)
        return
    for k in ("store", "source", "fingerprint", "documents", "chunks", "tokens", "bytes", "bytes_per_token",
              "dtype", "embedder"):
        out.print(f"{k:>16}: {info[k]}", highlight=False)


@store_app.command("verify")
def store_verify(
    store: StoreOpt = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Drop damaged chunks (re-ingest recreates them), rebuild the manifest from chunk files "
        "when it is damaged, adopt orphan files, rebuild the index.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check every chunk file against its checksums and the index against the manifest; exit 1 naming each
    damaged chunk."""
    from mot_cag.store.verify import verify_store

    report = verify_store(_store_path(store), repair=repair)
    if as_json:
        _print_json(report.to_dict())
    else:
        for n in report.notes:
            out.print(f"note: {n.kind} {n.subject}: {n.detail}" + (" (fixed)" if n.fixed else ""), highlight=False)
        for p in report.problems:
            what = f"{p.kind} chunk" if p.kind in ("damaged", "missing") else p.kind
            (out if p.fixed else err).print(f"{what} {p.subject}: {p.detail}", highlight=False, soft_wrap=True)
        out.print(f"{report.chunks_checked} chunks checked in {report.store}: "
                  + ("OK" if report.ok else f"{sum(not p.fixed for p in report.problems)} problems"), highlight=False)
    if not report.ok:
        raise typer.Exit(1)


@store_app.command("ls")
def store_ls(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """The store's documents: path, chunks, tokens and size; then the totals and the source model."""
    from mot_cag.store.manage import documents
    from mot_cag.store.store import Store

    path = _store_path(store)
    docs = documents(path)
    with Store.open(path) as st:
        info = st.info()
    if as_json:
        _print_json({"store": path, "source": info["source"], "documents": docs})
        return
    table = _table("document", "chunks", "tokens", "bytes")
    for d in docs:
        table.add_row(d["path"], str(d["chunks"]), f"{d['tokens']:,}", f"{d['size']:,}")
    out.print(table)
    out.print(f"{info['documents']} documents, {info['chunks']} chunks, {info['tokens']:,} tokens stored "
              f"({info['bytes']:,} bytes of KV); source {info['source']}.", highlight=False)


def _removed_line(r, what: str) -> str:
    return (f"{what}: {len(r.documents)} documents, {r.chunks} chunks ({r.chunk_files} chunk files, "
            f"{r.bytes_freed:,} bytes), {r.records} document records, {r.temp_files} temporary files removed.")


@store_app.command("rm")
def store_rm(
    paths: Annotated[list[str], typer.Argument(help="Documents to remove: files, or folders (every document "
                                                    "under them), as they were ingested.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove documents from the store, with the chunks no other document uses. Crash-safe: a store
    interrupted mid-removal still verifies; `store gc` finishes the cleanup."""
    from mot_cag.store.manage import remove_documents

    r = remove_documents(_store_path(store), paths)
    if as_json:
        _print_json(r.to_json())
        return
    for d in r.documents:
        out.print(f"removed {d}", highlight=False)
    out.print(_removed_line(r, "rm"), highlight=False)


@store_app.command("gc")
def store_gc(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Delete what no document uses: chunks without a document, chunk files without a manifest row (an
    interrupted ingest or removal), stale document records and temporary files; save the index."""
    from mot_cag.store.manage import gc

    r = gc(_store_path(store))
    if as_json:
        _print_json(r.to_json())
        return
    out.print(_removed_line(r, "gc"), highlight=False)


# ---------------------------------------------------------------------------------------------------- ask

PipelineOpt = Annotated[str | None, typer.Option(
    "--pipeline", help="Pipeline TOML (default: $MOT_CAG_PIPELINE, else pipelines/default.toml when present, else "
                       "the packaged defaults).")]


@app.command("ask")
def ask_cmd(
    question: Annotated[str, typer.Argument(help="The question; - reads it from standard input.")],
    target: Annotated[str | None, typer.Option(help="Model that answers (zoo name, alias, HF id, folder); default: "
                                                    "the pipeline's first target.")] = None,
    store: Annotated[str | None, typer.Option(help="Store folder (" + _pipeline_default("store") + ").")] = None,
    top_k: Annotated[int | None, typer.Option(help="Chunks to retrieve (" + _pipeline_default("top_k") + ").")] = None,
    mode: Annotated[str | None, typer.Option(metavar=MODE_CHOICES, help="What the target reads: translated caches, "
                                             "the text (direct), its own chunk caches (native-chunks) or nothing "
                                             "(none); " + _pipeline_default("mode") + ".")] = None,
    injection: InjectionOpt = None,
    replay_window: WindowOpt = None,
    recompute: RecomputeOpt = None,
    recompute_policy: RecomputePolicyOpt = None,
    translator: Annotated[str | None, typer.Option(help="Translator folder (default: found for the pair).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        help="Generation budget in tokens (" + _pipeline_default("max_new_tokens") + ").")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop sequence (repeatable): the answer ends before it. A line break always ends it.")] = None,
    device: Annotated[str | None, typer.Option(metavar="[auto|cpu|cuda]",
                                               help=_pipeline_default("device") + ".")] = None,
    pipeline: PipelineOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Answer a question from the store: retrieve chunks, translate their caches into the target's cache
    space, and let the target answer without prefilling the text. Prints the answer and the cited chunks."""
    from mot_cag.config import PipelineConfig
    from mot_cag.device import pick_device
    from mot_cag.pipeline.ask import Asker
    from mot_cag.pipeline.context import Recompute

    cfg = PipelineConfig.from_file(pipeline).override(store=store, top_k=top_k, mode=mode, injection=injection,
                                                      recompute=recompute, recompute_policy=recompute_policy,
                                                      replay_window=replay_window, max_new_tokens=max_new_tokens,
                                                      device=device)
    if question == "-":
        question = sys.stdin.read().strip()
    target = target or cfg.targets[0]
    asker = Asker(cfg.store, target, mode=cfg.mode, device=pick_device(cfg.device), translator=translator,
                  max_new_tokens=cfg.max_new_tokens, injection=cfg.injection,
                  recompute=Recompute.parse(cfg.recompute, cfg.recompute_policy), replay_window=cfg.replay_window)
    stream = (not as_json) and out.is_terminal
    if stream:
        out.print(f"[bold]{asker.target.name}[/bold] ({cfg.mode}): ", end="")
    res = asker.ask(question, top_k=cfg.top_k, stop=stop or [],
                    on_text=(lambda t: out.print(t, end="", highlight=False, markup=False)) if stream else None)
    if as_json:
        _print_json(res.to_dict())
        return
    if stream:
        out.print()
    else:
        out.print(f"{res.target} ({res.mode}): {res.answer}", highlight=False, markup=False)
    for c in res.chunks:
        snippet = c["text"].replace("\n", " ")
        snippet = snippet if len(snippet) <= 100 else snippet[:97] + "..."
        out.print(f"  [{c['score']:.3f}] {c['doc']}#{c['chunk']}: {snippet}", highlight=False, markup=False)
    t = res.timings
    out.print(f"  context {res.context_tokens} tokens; retrieve {t['retrieve_s']:.3f}s, load {t['load_s']:.3f}s, "
              f"translate {t['translate_s']:.3f}s, prefill {t['prefill_s']:.3f}s, ttft {t['ttft_s']:.3f}s, "
              f"total {t['total_s']:.3f}s", highlight=False)


@app.command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option(help="Address to listen on. The default is loopback only; anything else "
                                           "exposes your store to the network (no authentication).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    store: Annotated[str | None, typer.Option(help="Default store of requests (default from the pipeline); a "
                                                   "request may name another in its mot_cag field.")] = None,
    target: Annotated[list[str] | None, typer.Option(
        "--target", help="Target to load before serving (repeatable); others load on their first request.")] = None,
    mode: Annotated[str | None, typer.Option(metavar=MODE_CHOICES, help="Default context mode of requests ("
                                             + _pipeline_default("mode") + ").")] = None,
    injection: InjectionOpt = None,
    parallel: Annotated[int, typer.Option(help="Answers generated at once (on a CPU, 1: parallel answers "
                                               "share the same cores).")] = 1,
    max_pending: Annotated[int, typer.Option(help="Requests admitted at once (running or waiting); one more "
                                                  "gets HTTP 503.")] = 32,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, or auto (default from the pipeline).")] = None,
    pipeline: PipelineOpt = None,
) -> None:
    """Serve questions over HTTP with everything kept warm: OpenAI-compatible /v1/chat/completions and
    /v1/completions (the model field names the target; store, top_k, mode, injection in the mot_cag field),
    /v1/retrieve, /v1/models and /health. Several agents of different model families share one store."""
    from mot_cag.config import PipelineConfig
    from mot_cag.device import pick_device
    from mot_cag.server import serve

    cfg = PipelineConfig.from_file(pipeline).override(store=store, mode=mode, injection=injection, device=device)
    if parallel < 1 or max_pending < 1:
        raise MotCagError("--parallel and --max-pending must be at least 1.")
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"warning: listening on {host}: anyone who can reach it can read the store.", highlight=False)
    err.print(f"mot-cag serve: store {cfg.store}, http://{host}:{port} (Ctrl-C stops)", highlight=False)
    serve(cfg, host=host, port=port, device=pick_device(cfg.device), parallel=parallel, max_pending=max_pending,
          preload=target or [])


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line on stderr."""
    try:
        app()
    except MotCagError as e:
        err.print(f"error: {e}", highlight=False, soft_wrap=True, markup=False)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
