"""`mot-cag models`: list, prepare and check models."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from mot_cag.cli import (
    JsonOpt,
    _print_json,
    _table,
    models_app,
    out,
)
from mot_cag.errors import MotCagError

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
