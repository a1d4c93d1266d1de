"""Which tokens of a joined cache to recompute (CacheBlend-style cross-chunk repair).

Pieces of a document collection prefilled separately and joined into one chunk miss cross-chunk attention;
:func:`mot_cag.models.cache.selective_recompute` repairs the K/V of chosen tokens. This module chooses them:

* ``start``: the first tokens of every piece that does not begin the chunk (cheap, no model call);
* ``end``: the last tokens of the context, those next to the question (the most relevant piece is read last):
  recomputing a tail is a prefill of those tokens over the joined cache before them (no model call to choose);
* ``spread``: evenly spaced tokens, a structure-blind baseline (no model call);
* :func:`deviation_indices`: CacheBlend's choice, the tokens whose K/V at an early layer deviate most from a
  single-pass prefill's (one partial pass of the model).

``ratio`` is always the fraction of the chunk's tokens to recompute, so ``ratio=1`` recomputes everything (a
full prefill) and ``ratio=0`` nothing.
"""

from __future__ import annotations

import math

import torch

from mot_cag.models import cache as kv
from mot_cag.names import POSITIONAL_POLICIES, PositionalPolicy


def recompute_count(n_tokens: int, ratio: float) -> int:
    """How many of ``n_tokens`` tokens a recompute ``ratio`` selects.

    Rounds half up, and a positive ratio selects at least one token: asking for some repair gets some.

    Raises:
        ValueError: ``ratio`` is not a number in [0, 1] or ``n_tokens`` is negative.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be a number in [0, 1] (the fraction of tokens); got {ratio!r}.")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0; got {n_tokens}.")
    if ratio == 0 or n_tokens == 0:
        return 0
    return min(n_tokens, max(1, math.floor(ratio * n_tokens + 0.5)))


def _check_piece_starts(piece_starts: list[int], n_tokens: int) -> list[int]:
    starts = list(piece_starts)
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or any(not 0 <= s < n_tokens for s in starts):
        raise ValueError(
            f"piece_starts must be strictly increasing chunk-relative indices in [0, {n_tokens}); got {starts}."
        )
    return starts


def _start_order(n_tokens: int, piece_starts: list[int]) -> list[int]:
    """All token indices, most in need of repair first (see :func:`recompute_indices`)."""
    bounds = [*piece_starts, n_tokens]
    pieces = [range(s, e) for s, e in zip(bounds, bounds[1:], strict=False) if s > 0]
    order: list[int] = []
    # Round-robin over pieces by offset: every piece's first token, then every piece's second, ...
    for offset in range(max((len(p) for p in pieces), default=0)):
        order.extend(p[offset] for p in pieces if offset < len(p))
    chosen = set(order)
    # Tokens of a piece starting at 0 (and any prefix before the first piece) already have their full context.
    order.extend(i for i in range(n_tokens) if i not in chosen)
    return order


def recompute_indices(policy: PositionalPolicy, n_tokens: int, ratio: float, piece_starts: list[int]) -> list[int]:
    """Chunk-relative indices of the tokens to recompute, sorted.

    ``start`` takes the first tokens of every piece that does not start the chunk, round-robin over pieces.
    Those tokens lost the most context: a piece's first token was prefilled attending to itself only, where a
    single pass lets it attend to every earlier piece, and each later token of the piece attends to them (a
    piece's leading tokens collect much of its attention, like an attention sink), so their error spreads
    through the whole piece. Tokens of the piece at position 0 already had all their context; they come last,
    so they are only picked once every other token is (``ratio=1``: all tokens).

    ``end`` takes the last ``k`` tokens: the tail next to the question, where the most relevant piece stands
    (:func:`mot_cag.pipeline.retrieval.context_order`). Recomputed, the tail attends to every earlier piece as in
    one pass over the text, which is what the question reads most.

    ``spread`` takes ``k`` evenly spaced tokens over the whole chunk, ignoring pieces: a baseline.

    Args:
        policy: One of :data:`~mot_cag.names.POSITIONAL_POLICIES` (the deviation policy needs the model:
            :func:`deviation_indices`).
        n_tokens: Length of the joined chunk.
        ratio: Fraction of the tokens to recompute, in [0, 1] (see :func:`recompute_count`).
        piece_starts: Chunk-relative index of each piece's first token, strictly increasing (``[0, 12, 30]``).

    Raises:
        ValueError: Unknown policy, ratio outside [0, 1], or bad ``piece_starts``.
    """
    if policy not in POSITIONAL_POLICIES:
        raise ValueError(
            f"unknown recompute policy {policy!r}; choose one of {', '.join(POSITIONAL_POLICIES)} (CacheBlend's "
            "KV-deviation choice needs the model: use deviation_indices)."
        )
    k = recompute_count(n_tokens, ratio)
    starts = _check_piece_starts(piece_starts, n_tokens)
    if policy == "end":
        return list(range(n_tokens - k, n_tokens))
    if policy == "spread":
        # Centre of each of k equal bins; strictly increasing because n_tokens / k >= 1.
        return [(2 * i + 1) * n_tokens // (2 * k) for i in range(k)]
    return sorted(_start_order(n_tokens, starts)[:k])


def deviation_indices(model, chunk: kv.KVChunk, input_ids: torch.Tensor, ratio: float, layer: int = 1) -> list[int]:
    """CacheBlend's choice: the tokens whose K/V at an early layer deviate most from a single-pass prefill's.

    The reference K/V of ``layer`` come from :func:`mot_cag.models.cache.layer_kv`, a pass over the whole
    sequence that stops at that layer's K/V projection: about ``(layer + 1) / layers`` of a prefill's
    transformer blocks, no LM head. Layer 0 is useless here: its K/V depend only on each token and its
    position, so a correctly placed chunk already has them exact; layer 1 is the first that sees the missing
    cross-chunk attention, hence the default.

    Args:
        model: A Hugging Face causal LM.
        chunk: Joined KV of ``input_ids``; ``chunk.start`` is the global position of ``input_ids[0]``.
        input_ids: ``[seq]`` token ids the chunk covers.
        ratio: Fraction of tokens to pick, in [0, 1] (see :func:`recompute_count`).
        layer: Layer to compare at; clamped to the model's last layer.

    Returns:
        Sorted chunk-relative indices; deviation is the squared L2 distance over ``kv_heads * head_dim`` of the
        keys plus that of the values. Ties go to the earlier token.

    Raises:
        ValueError: Bad ratio, negative layer, or ``input_ids`` not the chunk's length.
    """
    n_tokens = chunk.length
    if input_ids.numel() != n_tokens:
        raise ValueError(f"input_ids has {input_ids.numel()} tokens but the chunk covers {n_tokens}.")
    if layer < 0:
        raise ValueError(f"layer must be >= 0; got {layer}.")
    k = recompute_count(n_tokens, ratio)
    if k == 0:
        return []
    layer = min(layer, chunk.keys.shape[0] - 1)
    ref_k, ref_v = kv.layer_kv(model, input_ids, layer, start=chunk.start)  # (H, T, D) each
    dk = ref_k.float() - chunk.keys[layer].to(ref_k.device, torch.float32)
    dv = ref_v.float() - chunk.values[layer].to(ref_v.device, torch.float32)
    deviation = dk.pow(2).sum(dim=(0, 2)) + dv.pow(2).sum(dim=(0, 2))  # (T,)
    order = torch.argsort(deviation, descending=True, stable=True)
    return sorted(order[:k].tolist())
