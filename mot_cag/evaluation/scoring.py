"""Evaluate a target model on a dataset in several context modes (``mot-cag eval``).

Per example and mode the context is built once (see :mod:`mot_cag.pipeline.context`), then:

- extractive (has ``cue`` or plain QA): greedy answer after the target's prompt
  (:class:`~mot_cag.prompts.PromptFormat`: ``Answer: {cue}`` for the zoo, the chat template for real
  instruct models); exact match, F1 and "contains the answer" (chatty models restate the question);
- closed set (``options``): the option with the highest log-likelihood of `` {option}.`` after the cue;
- repeat (``task == "repeat"``): teacher-forced top-1 accuracy on the repeated document (first token excluded);
- all: mean NLL per token of the reference continuation, and KL(p_direct || p_mode) of the next-token
  distributions along it (teacher-forced), which measure how much of the context's effect a mode keeps.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mot_cag.evaluation.metrics import contains_answer, exact_match, kl_rows, token_f1
from mot_cag.models import cache as kv
from mot_cag.models.registry import LoadedModel
from mot_cag.pipeline.context import ContextBuilder, DirectContext, Piece, TargetContext
from mot_cag.pipeline.generate import continuation_rule, fits, generate
from mot_cag.prompts import (
    REPEAT_SUFFIX,
    PromptFormat,
    as_tensor,
    encode,
    prompt_format,
    repeat_continuation,
)


def example_kind(ex: dict) -> str:
    """``repeat``, ``closed`` or ``extractive``."""
    if ex.get("task") == "repeat":
        return "repeat"
    return "closed" if ex.get("options") else "extractive"


@dataclass
class ExampleResult:
    """Scores of one example in one mode."""

    id: str
    mode: str
    kind: str
    nll: float
    ref_tokens: int
    ttft_s: float
    prediction: str | None = None
    exact_match: float | None = None
    f1: float | None = None
    contains: float | None = None
    correct: float | None = None
    token_accuracy: float | None = None
    kl_to_direct: float | None = None
    template: str | None = None
    retrieved_docs: list[str] = field(default_factory=list)
    recall_hit: float | None = None
    context_tokens: int = 0


def _suffix_and_reference(ex: dict, prompt: PromptFormat) -> tuple[str, str]:
    if example_kind(ex) == "repeat":
        return REPEAT_SUFFIX, repeat_continuation(ex.get("answer") or ex["context"])
    return prompt.suffix_text(ex["question"], ex.get("cue")), prompt.reference(str(ex["answer"]))


class Evaluator:
    """Runs examples through context builders and scores them.

    Args:
        target: The answering model.
        builders: Mode name -> context builder for ``target``.
        max_new_tokens: Generation budget for extractive answers.
    """

    def __init__(self, target: LoadedModel, builders: dict[str, ContextBuilder], max_new_tokens: int = 24):
        self.target = target
        self.builders = builders
        self.max_new_tokens = max_new_tokens
        self.reference = builders.get("direct") or DirectContext(target)
        first = next(iter(builders.values()), None)
        self.prompt = first.prompt if first is not None else prompt_format(target)

    # ------------------------------------------------------------------------------------------- pieces

    @torch.no_grad()
    def _teacher_forced(self, ctx: TargetContext, suffix_ids: list[int], ref_ids: list[int]) -> torch.Tensor:
        """Log-probabilities ``[len(ref), vocab]`` of each reference token's position."""
        ids = as_tensor(suffix_ids + ref_ids, self.target.device)
        logits, _ = kv.forward(self.target.model, ids, ctx.kv, keep_cache=False)
        rows = logits[len(suffix_ids) - 1: len(suffix_ids) + len(ref_ids) - 1].float()  # (R, V)
        return torch.log_softmax(rows, dim=-1)

    @torch.no_grad()
    def _options(self, ctx: TargetContext, suffix_ids: list[int], options: list[str]) -> int:
        logits, after = kv.forward(self.target.model, as_tensor(suffix_ids, self.target.device), ctx.kv)
        first = torch.log_softmax(logits[-1].float(), -1)
        scores = []
        for opt in options:
            ids = encode(self.target.tokenizer, self.prompt.reference(opt))
            lp = first[ids[0]].item()
            if len(ids) > 1:
                more, _ = kv.forward(self.target.model, as_tensor(ids[:-1], self.target.device), after,
                                     keep_cache=False)
                lps = torch.log_softmax(more.float(), -1)
                lp += lps[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
            scores.append(lp)
        return max(range(len(options)), key=scores.__getitem__)

    # ------------------------------------------------------------------------------------------ example

    def run_example(self, ex: dict, pieces: list[Piece]) -> list[ExampleResult]:
        """Score one example in every mode."""
        tok = self.target.tokenizer
        kind = example_kind(ex)
        suffix, ref = _suffix_and_reference(ex, self.prompt)
        suffix_ids, ref_ids = encode(tok, suffix), encode(tok, ref)
        direct_lp = None
        results = []
        log_probs: dict[str, torch.Tensor] = {}
        ordered = sorted(self.builders, key=lambda m: m != "direct")
        for mode in ordered:
            builder = self.builders[mode]
            t0 = time.perf_counter()
            ctx = builder.build(pieces)
            needed = ctx.tokens + len(suffix_ids) + len(ref_ids)
            if not fits(self.target, needed, reserve=2):
                raise ContextTooLong(f"example {ex.get('id')} needs {needed} positions; the target has "
                                     f"{self.target.layout.max_positions}")
            res = ExampleResult(str(ex.get("id")), mode, kind, 0.0, len(ref_ids), 0.0,
                                template=ex.get("template"), context_tokens=ctx.tokens)
            if kind == "extractive" or kind == "closed":
                gen = generate(self.target, ctx.kv, suffix_ids, self.max_new_tokens, continuation_rule(self.prompt),
                               t0, ban_first=self.prompt.first_token_bans)
                res.prediction, res.ttft_s = self.prompt.extract(gen.text), gen.ttft_s
                res.exact_match = exact_match(res.prediction, str(ex["answer"]))
                res.f1 = token_f1(res.prediction, str(ex["answer"]))
                res.contains = contains_answer(res.prediction, str(ex["answer"]))
            lp = self._teacher_forced(ctx, suffix_ids, ref_ids)
            if kind != "extractive" and kind != "closed":
                res.ttft_s = time.perf_counter() - t0
            gather = lp[torch.arange(len(ref_ids)), torch.tensor(ref_ids)]
            res.nll = float(-gather.mean())
            if kind == "repeat" and len(ref_ids) > 1:
                res.token_accuracy = float((lp[1:].argmax(-1) == torch.tensor(ref_ids[1:])).float().mean())
            if kind == "closed":
                res.correct = float(self._options(ctx, suffix_ids, ex["options"]) == int(ex["answer_index"]))
            log_probs[mode] = lp
            if mode == "direct":
                direct_lp = lp
            results.append(res)
        if direct_lp is None and any(m != "direct" for m in self.builders):
            direct_lp = self._teacher_forced(self.reference.build(pieces), suffix_ids, ref_ids)
        for res in results:
            res.kl_to_direct = float(kl_rows(direct_lp, log_probs[res.mode]).mean()) if direct_lp is not None else None
        return results


class ContextTooLong(Exception):
    """An example does not fit the target's position range."""


# ---------------------------------------------------------------------------------------------- aggregate


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def aggregate(results: list[ExampleResult]) -> dict:
    """cli.md's per-mode record (plus ``by_template`` and ``n``) from example results of one mode."""
    rec = {
        "n": len(results),
        "exact_match": _mean([r.exact_match for r in results]),
        "f1": _mean([r.f1 for r in results]),
        "contains_answer": _mean([r.contains for r in results]),
        "accuracy": _mean([r.correct for r in results]),
        "token_accuracy": _mean([r.token_accuracy for r in results]),
        "nll": _mean([r.nll for r in results]),
        "kl_to_direct": _mean([r.kl_to_direct for r in results]),
        "retrieval_recall": _mean([r.recall_hit for r in results]),
        "mean_ttft_s": _mean([r.ttft_s for r in results]),
    }
    by_template: dict[str, list[ExampleResult]] = defaultdict(list)
    for r in results:
        if r.template:
            by_template[r.template].append(r)
    if len(by_template) > 1:
        rec["by_template"] = {
            t: {"n": len(rs), "exact_match": _mean([r.exact_match for r in rs]), "f1": _mean([r.f1 for r in rs]),
                "accuracy": _mean([r.correct for r in rs]), "nll": _mean([r.nll for r in rs])}
            for t, rs in sorted(by_template.items())
        }
    return rec


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def retention(modes: dict[str, dict]) -> dict | None:
    """Translated relative to direct (cli.md), with the NLL/KL context-benefit shares when ``none`` ran."""
    if "translated" not in modes or "direct" not in modes:
        return None
    t, d, n = modes["translated"], modes["direct"], modes.get("none")
    out = {k: _ratio(t.get(k), d.get(k)) for k in ("f1", "exact_match", "contains_answer", "accuracy",
                                                    "token_accuracy")}
    out["nll_benefit"] = None
    out["kl_benefit"] = None
    if n is not None:
        gap = n["nll"] - d["nll"]
        out["nll_benefit"] = (n["nll"] - t["nll"]) / gap if gap and not math.isclose(gap, 0.0) else None
        if n["kl_to_direct"]:
            out["kl_benefit"] = 1.0 - t["kl_to_direct"] / n["kl_to_direct"]
    return out


def evaluate(
    examples: list[dict],
    evaluator: Evaluator,
    pieces_for: Callable[[dict], tuple[list[Piece], float | None]],
    progress: Callable[[int], None] | None = None,
) -> tuple[dict, list[ExampleResult]]:
    """Run every example; returns (``{"n", "skipped", "modes": {...}, "retention"}``, example results).

    Args:
        examples: Dataset rows.
        evaluator: Scores one example in each mode.
        pieces_for: Example -> (context pieces, retrieval hit or ``None``).
        progress: Called with 1 after each example.
    """
    per_mode: dict[str, list[ExampleResult]] = defaultdict(list)
    skipped = 0
    all_results = []
    for ex in examples:
        pieces, hit = pieces_for(ex)
        try:
            rs = evaluator.run_example(ex, pieces)
        except ContextTooLong:
            skipped += 1
            rs = []
        for r in rs:
            r.recall_hit = hit
            r.retrieved_docs = [p.doc for p in pieces if p.doc]
            per_mode[r.mode].append(r)
            all_results.append(r)
        if progress:
            progress(1)
    modes = {m: aggregate(rs) for m, rs in per_mode.items()}
    return {"n": len(examples) - skipped, "skipped": skipped, "modes": modes, "retention": retention(modes)}, \
        all_results
