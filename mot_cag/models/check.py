"""Self-check of the cache layer on one model: cached continuation must equal a single forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mot_cag.models import cache as kv
from mot_cag.models.positions import Positioner
from mot_cag.models.registry import LoadedModel

CHECK_TEXT = (
    "Ana Brell was born in Corvale. The favorite color of Ana Brell is green. Tomas Reddick works as a baker.\n"
    "Question: Where was Ana Brell born?\nAnswer: Ana Brell was born in Corvale."
)


@dataclass
class CheckResult:
    """Outcome of :func:`check_model`."""

    model: str
    tokens: int
    continue_max_abs_diff: float
    reposition_max_abs_diff: float | None
    tolerance: float

    @property
    def passed(self) -> bool:
        diffs = [self.continue_max_abs_diff] + (
            [self.reposition_max_abs_diff] if self.reposition_max_abs_diff is not None else []
        )
        return max(diffs) <= self.tolerance


@torch.no_grad()
def check_model(lm: LoadedModel, text: str = CHECK_TEXT, tolerance: float = 1e-3) -> CheckResult:
    """Prefill the first half of ``text``, continue with the rest, and compare logits with one pass.

    For RoPE models it also prefills part of the second half alone at position 0, moves it to its real
    position and compares its K/V with the same tokens prefilled in place (every layer, so every RoPE base of
    models whose base differs by layer type). For models with sliding-window layers the text is repeated
    until it is longer than the window, so the continuation reads past the window.
    """
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"][0].to(lm.device)
    window = lm.layout.sliding_window
    if window and ids.shape[0] <= window + 32:
        body = lm.tokenizer(" " + text, add_special_tokens=False, return_tensors="pt")["input_ids"][0].to(lm.device)
        reps = (window + 64 - ids.shape[0]) // body.shape[0] + 1
        ids = torch.cat([ids] + [body] * reps)
        # Continue from a point past the window, so the cached part alone exceeds it.
    half = ids.shape[0] // 2 if not window else max(ids.shape[0] // 2, min(window + 16, ids.shape[0] - 16))
    full_logits, _ = kv.forward(lm.model, ids, keep_cache=False)
    ctx = kv.prefill(lm.model, ids[:half])
    cont_logits, _ = kv.forward(lm.model, ids[half:], ctx, keep_cache=False)
    diff = (cont_logits - full_logits[half:]).abs().max().item()
    repo_diff = None
    if lm.layout.positions == "rope":
        # Chunk B prefilled alone at 0 vs at its real position `half`, both read by the same last tokens.
        third = half + (ids.shape[0] - half) // 2
        b_at_0 = kv.prefill(lm.model, ids[half:third], start=0)
        b_native = kv.prefill(lm.model, ids[half:third], start=half)
        moved = Positioner(lm.layout, lm.model.config).reposition(b_at_0, half)
        repo_diff = max(
            (moved.keys - b_native.keys).abs().max().item(),
            (moved.values - b_native.values).abs().max().item(),
        )
    return CheckResult(lm.name, int(ids.shape[0]), diff, repo_diff, tolerance)
