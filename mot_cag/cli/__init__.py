"""The ``mot-cag`` command line: parses options, calls the library, prints. No work lives here.

This module holds the app, the consoles and the shared options; each command group lives in a module of
this package (models, data, evaluate, store, ask), registered by the imports at the end.

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
from mot_cag.names import CONTEXT_MODES, INJECTIONS, RECOMPUTE_POLICIES

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


MODE_CHOICES = _choices(CONTEXT_MODES)
RecomputeOpt = Annotated[str | None, typer.Option(
    metavar="[auto|0-1]",
    help="Cross-chunk repair: fraction of context tokens (0-1) whose K/V are recomputed against the whole "
         "context (CacheBlend-style; native-chunks and translated modes). 0 = off; auto (default) = the measured "
         "default: 0.35 for a real model's own stored chunks, 0.5 for real pairs injected in every layer, 0 for "
         "replay injections and the zoo "
         "(docs/chunk-caches.md, docs/translators-real.md).")]
RecomputePolicyOpt = Annotated[str | None, typer.Option(
    metavar=_choices(RECOMPUTE_POLICIES),
    help="Which tokens --recompute picks: end (the last tokens, next to the question, where the most relevant "
         "chunk stands), deviation (largest layer-1 K/V deviation from a partial single pass), start (first tokens "
         "of each chunk) or spread (evenly spaced); " + _pipeline_default("recompute_policy")
         + ".")]
InjectionOpt = Annotated[str | None, typer.Option(
    metavar=_choices(INJECTIONS),
    help="How translated caches enter the target: auto (real models' translators: inject-all, then the context's "
         "tail recomputed; the zoo's: replay-joint), inject-all (translated K/V are "
         "the cache; fastest; old spelling: direct), replay (the target re-runs each chunk with translated K/V "
         "in its window layers) or "
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


PipelineOpt = Annotated[str | None, typer.Option(
    "--pipeline", help="Pipeline TOML (default: $MOT_CAG_PIPELINE, else pipelines/default.toml when present, else "
                       "the packaged defaults).")]

StoreOpt = Annotated[str | None, typer.Option(
    "--store", help="Store folder (default: the pipeline's store; MOT_CAG_STORE overrides it).")]


def _store_path(store: str | None) -> str:
    """``--store`` or, when absent, the default pipeline's store (with the environment's overrides)."""
    if store:
        return store
    from mot_cag.config import PipelineConfig

    return str(PipelineConfig.from_file(None).store)


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


# Command groups register themselves on ``app`` when imported (the order is the order of --help).
# isort: off
from mot_cag.cli import models as _models  # noqa: E402, F401
from mot_cag.cli import data as _data  # noqa: E402, F401
from mot_cag.cli import evaluate as _evaluate  # noqa: E402, F401
from mot_cag.cli import store as _store  # noqa: E402, F401
from mot_cag.cli import ask as _ask  # noqa: E402, F401
from mot_cag.cli.evaluate import train_cmd  # noqa: E402, F401 - imported by tests and scripts
# isort: on
