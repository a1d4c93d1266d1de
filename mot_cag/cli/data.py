"""`mot-cag data` and `mot-cag zoo`: synthetic data, held-out corpora, the zoo's recipe."""

from __future__ import annotations

from typing import Annotated

import typer

from mot_cag.cli import (
    JsonOpt,
    _print_json,
    app,
    err,
    out,
)
from mot_cag.errors import MotCagError

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
    from mot_cag.data.jsonl import write_jsonl
    from mot_cag.data.synthetic import synth_dataset

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
    from mot_cag.zoo.train import RUNS_DIR, ZooTrainConfig, export_latest, train

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
    cfg = ZooTrainConfig(seed=seed, device=device, **{k: v for k, v in given.items() if v is not None})
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
