"""``mot-cag eval`` as a library call: load models and data, build the modes, run, report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mot_cag.errors import MotCagError
from mot_cag.evaluation.datasets import load_examples
from mot_cag.evaluation.scoring import Evaluator, ExampleResult, evaluate
from mot_cag.models.registry import LoadedModel, load_model
from mot_cag.names import (
    CONTEXT_MODES,
    DEFAULT_RECOMPUTE_POLICY,
    INJECTIONS,
    ContextMode,
    Injection,
    RecomputePolicy,
    choose,
)
from mot_cag.pipeline.context import Piece, Recompute
from mot_cag.pipeline.translation import builder_for


@dataclass
class EvalRequest:
    """What to evaluate (mirrors the CLI options)."""

    dataset: str
    target: str
    source: str | None = None
    modes: list[ContextMode] = field(default_factory=list)
    store: str | None = None
    top_k: int = 4
    limit: int | None = None
    seed: int = 0
    device: str = "auto"
    translator: str | None = None
    max_new_tokens: int = 24
    injection: Injection = "auto"
    recompute: float | str = "auto"
    recompute_policy: RecomputePolicy = DEFAULT_RECOMPUTE_POLICY
    replay_window: float | str = "auto"


def default_modes(source: str | None) -> list[str]:
    """Every mode when a source model is named, else the target alone with and without the context."""
    return list(CONTEXT_MODES) if source else ["direct", "none"]


def _check_modes(modes: list[str], source: str | None) -> None:
    for mode in modes:
        choose("context mode", mode, CONTEXT_MODES)
    if "translated" in modes and not source:
        raise MotCagError("Mode 'translated' needs a source model: pass --source NAME (the model that prefilled).")


def run_eval(req: EvalRequest, progress: Callable[[int, int], Callable[[int], None]] | None = None) -> tuple[
        dict, list[ExampleResult]]:
    """Evaluate ``req.target`` on ``req.dataset`` in ``req.modes``.

    Returns:
        The cli.md report (``n``, ``source``, ``target``, ``modes``, ``retention``, plus ``skipped``) and the
        per-example results.
    """
    from mot_cag.device import pick_device

    if req.store and not req.source:
        from mot_cag.pipeline.retrieval import open_store

        req.source = open_store(req.store).source.name  # a store's caches come from its own source model
    modes = list(dict.fromkeys(req.modes or default_modes(req.source)))
    _check_modes(modes, req.source)

    req.injection = choose("injection", req.injection, INJECTIONS)
    device = pick_device(req.device)
    torch.manual_seed(req.seed)
    target = load_model(req.target, device=device)
    source = load_model(req.source, device=device) if req.source else None
    examples = load_examples(req.dataset, limit=req.limit, seed=req.seed)
    if not examples:
        raise MotCagError(f"Dataset {req.dataset} has no examples.")

    repair = Recompute.parse(req.recompute, req.recompute_policy)
    prefix: tuple[int, ...] = ()  # without a store each context is prefilled alone (see _pieces_from_examples)
    if req.store:
        from mot_cag.store.store import Store

        prefix = Store.read_config(req.store).prefix_ids
    builders = {m: builder_for(m, target, repair, source, req.translator, req.injection, prefix, req.replay_window)
                for m in modes}
    evaluator = Evaluator(target, builders, max_new_tokens=req.max_new_tokens)
    pieces_for = _pieces_from_examples(source) if not req.store else _pieces_from_store(req, source, target)
    tick = progress(len(examples), 0) if progress else None
    report, results = evaluate(examples, evaluator, pieces_for, tick)
    report = {"n": report["n"], "source": source.name if source else None, "target": target.name,
              "modes": report["modes"], "retention": report["retention"], "skipped": report["skipped"],
              "dataset": req.dataset, "injection": req.injection if "translated" in modes else None,
              "recompute": {"requested": req.recompute, "policy": req.recompute_policy,
                            "ratio": {m: b.recompute.ratio for m, b in builders.items() if hasattr(b, "recompute")}}}
    return report, results


def _pieces_from_examples(source: LoadedModel | None) -> Callable[[dict], tuple[list[Piece], float | None]]:
    """Each example's own ``context`` is one piece; its source KV is the source model's prefill of it."""
    from mot_cag.models import cache as kv
    from mot_cag.prompts import as_tensor, encode

    def pieces_for(ex: dict) -> tuple[list[Piece], float | None]:
        text = ex.get("context") or ""
        load = None
        if source is not None:
            def load(text=text):
                return kv.prefill(source.model, as_tensor(encode(source.tokenizer, text), source.device))
        return ([Piece(text, key=None, source_kv=load)] if text else []), None

    return pieces_for


def _pieces_from_store(req: EvalRequest, source: LoadedModel | None, target: LoadedModel):
    from mot_cag.pipeline.retrieval import store_pieces_for

    return store_pieces_for(req.store, top_k=req.top_k, source=source, device=target.device)
