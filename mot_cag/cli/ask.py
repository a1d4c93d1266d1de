"""`mot-cag ask` and `mot-cag serve`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mot_cag.cli import (
    MODE_CHOICES,
    InjectionOpt,
    JsonOpt,
    PipelineOpt,
    RecomputeOpt,
    RecomputePolicyOpt,
    WindowOpt,
    _pipeline_default,
    _print_json,
    app,
    err,
    out,
)
from mot_cag.errors import MotCagError


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
