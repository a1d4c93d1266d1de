"""The whole recipe behind ``mot-cag train``: load both models, build (or fit) the translator a
:class:`TrainRequest` names, train it, score it on held-out pairs and save it where ``mot-cag translators``
finds it."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mot_cag.device import pick_device
from mot_cag.errors import MotCagError
from mot_cag.models.registry import load_model
from mot_cag.names import COVERAGES
from mot_cag.prompts import prefixes_chunks, prompt_format
from mot_cag.translate.checkpoint import pair_dirname, save_translator, user_dir
from mot_cag.translate.data import Pair, document_pairs, prose_pairs, real_text_pairs, synthetic_pairs
from mot_cag.translate.mot import build_translator
from mot_cag.translate.resume import state_dir_for
from mot_cag.translate.ridge import fit_ridge_translator
from mot_cag.translate.spec import TranslatorSpec
from mot_cag.translate.train import Heads, TrainConfig, evaluate_translator, example_stream, train_translator


@dataclass
class TrainRequest:
    """What ``mot-cag train`` asks for (library entry point :func:`run_training`).

    Attributes:
        source: Source model name.
        target: Target model name.
        spec: The translator to build (kind, coverage, experts, token features...).
        train: Optimisation settings.
        out: Output directory (default: the user translator directory, ``<source>__<target>``).
        eval_examples: Held-out pairs (eval split, fresh seed) scored after training (0: skip).
        device: ``auto``, ``cpu``, ``cuda``...
        half: Store the weights as float16.
        fresh: Discard the saved state of an interrupted run of this output folder and start over (otherwise a
            run with the same settings continues from it; :mod:`mot_cag.translate.resume`).
    """

    source: str
    target: str
    spec: TranslatorSpec = field(default_factory=lambda: TranslatorSpec(kind="mot"))
    train: TrainConfig = field(default_factory=TrainConfig)
    out: str | None = None
    eval_examples: int = 16
    device: str = "auto"
    half: bool = False
    fresh: bool = False


def heldout_pairs(n: int, seed: int = 12345, data: str = "synthetic") -> list[Pair]:
    """Held-out pairs of the kind ``data`` names: the eval split (invented strings, package files) and a seed
    training never uses. Training files have no held-out split here: synthetic pairs stand in."""
    streams = {"documents": document_pairs, "prose": prose_pairs, "real": real_text_pairs}
    return list(itertools.islice(streams.get(data, synthetic_pairs)(seed, split="eval"), n))


def run_training(req: TrainRequest, log: Callable[[dict], None] | None = None) -> dict:
    """Load both models, build and train (or fit) a translator, save it, score it on held-out pairs.

    Returns:
        ``{"source", "target", "kind", "coverage", "experts", "params", "path", "seconds", "final", "eval"}``.
    """
    t0 = time.time()
    device = pick_device(req.device)
    source = load_model(req.source, device=device)
    target = load_model(req.target, device=device)
    if req.train.chunk_prefix == "auto":
        both = all(prefixes_chunks(prompt_format(lm), lm.layout.positions) for lm in (source, target))
        req.train.chunk_prefix = "prompt" if both else "none"
    torch.manual_seed(req.train.seed)
    spec = req.spec
    suffix = "" if spec.label == "mot" and spec.coverage == "inject-all" else f"{spec.label}-{spec.coverage}"
    out = Path(req.out) if req.out else user_dir() / pair_dirname(req.source, req.target, suffix)
    partial = state_dir_for(out)
    if req.fresh:
        shutil.rmtree(partial, ignore_errors=True)
    try:
        if spec.kind == "ridge":
            translator = fit_ridge_translator(source, target, example_stream(source, target, req.train),
                                              req.train.calibration_tokens, req.train.ridge_lambda, spec)
            # What it was fitted on (trained kinds record it in train_translator).
            translator.config.training["config"] = asdict(req.train)
        else:
            translator = build_translator(source, target, spec)
            train_translator(translator, source, target, req.train, log=log, state_dir=partial)
    except ValueError as e:
        raise MotCagError(str(e)) from None
    heads = None
    if req.train.chunk_prefix == "prompt":
        heads = Heads.of(source, target)
        translator.config.source_head = list(prompt_format(source).head)
        translator.config.target_head = list(prompt_format(target).head)
    result = {"source": req.source, "target": req.target, "kind": translator.config.kind, "coverage": spec.coverage,
              "experts": translator.config.experts, "params": translator.parameter_count()}
    if req.eval_examples:
        pairs = heldout_pairs(req.eval_examples, data=req.train.data)
        ways = ("inject-all",) if heads is not None else COVERAGES
        result["eval"] = {m: evaluate_translator(translator, source, target, pairs, m, req.train.max_context_tokens,
                                                 heads)
                          for m in ways if not (m == "inject-all" and spec.coverage == "replay")}
        translator.config.training["heldout"] = result["eval"]
    save_translator(translator, out, half=req.half)
    shutil.rmtree(partial, ignore_errors=True)  # the run is complete: its resumable state is not needed
    result.update({"path": str(out), "seconds": round(time.time() - t0, 1),
                   "final": {k: v for k, v in translator.config.training.get("final", {}).items()}})
    return result
