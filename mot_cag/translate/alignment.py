"""Cross-tokenizer alignment: which source tokens carry the text of each target token.

Source and target tokenize the same text differently (GPT-2 and OPT put the leading space inside the next
token, OPT prepends ``</s>``, BPE merges differ). The translator works on the *target's* token grid, so source
KV rows are averaged onto target tokens with a row-normalised character-overlap matrix::

    W[t, s] = |chars(t) ∩ chars(s)| / sum_s' |chars(t) ∩ chars(s')|        # (T_tgt, T_src)
    kv_on_target_grid = W @ kv_source                                        # (T_tgt, width)

Overlap is counted on non-whitespace characters first, so ``" Brell"`` and ``"Brell"`` align exactly even
though one tokenizer keeps the space and the other does not; a token made only of whitespace falls back to
all characters. Special tokens with an empty span (OPT's ``</s>``) overlap nothing: a *leading* one keeps an
all-zero row, which :func:`mot_cag.translate.inject.translate` fills with the target's own KV (a leading
token attends only to itself, so its KV does not depend on the context); any other token without overlap
takes the nearest preceding source token.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import NamedTuple

import torch


class Alignment(NamedTuple):
    """Token ids of one text under both tokenizers and the matrix that maps source rows onto target rows.

    Attributes:
        src_ids: ``[T_src]`` source token ids (what the source prefills).
        tgt_ids: ``[T_tgt]`` target token ids (the grid of the translated cache).
        W: ``[T_tgt, T_src]`` row-normalised overlap; all-zero rows mark leading target-only tokens.
    """

    src_ids: torch.Tensor
    tgt_ids: torch.Tensor
    W: torch.Tensor


#: Fingerprints already computed, per tokenizer object: serialising a large vocabulary (Gemma's 262k entries) takes
#: ~0.4 s, which every translated chunk used to pay in its alignment.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a fast tokenizer's behaviour (vocab, merges, normaliser, specials), 16 hex chars.

    Computed once per tokenizer object and size (adding tokens changes the size, so the fingerprint is computed
    again)."""
    size = len(tokenizer)
    try:
        cached = _FINGERPRINTS.get(tokenizer)
    except TypeError:  # an object that cannot be weakly referenced: no cache
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
    try:
        _FINGERPRINTS[tokenizer] = (size, fingerprint)
    except TypeError:
        pass
    return fingerprint


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers split every text identically (so the alignment is the identity)."""
    return a is b or tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    return torch.tensor(enc["input_ids"], dtype=torch.long), [tuple(o) for o in enc["offset_mapping"]]


def _owners(offsets: list[tuple[int, int]], n_chars: int) -> torch.Tensor:
    """``[n_chars]``: the token covering each character (-1 for none; the later token where spans overlap,
    as byte-level pieces of one character do)."""
    owner = torch.full((n_chars,), -1, dtype=torch.long)
    for i, (b, e) in enumerate(offsets):
        if e > b:
            owner[b:e] = i
    return owner


def _counts(src_owner: torch.Tensor, tgt_owner: torch.Tensor, use: torch.Tensor, shape: tuple[int, int]):
    """Shared-character counts ``[T_tgt, T_src]`` over the characters selected by ``use``."""
    keep = use & (src_owner >= 0) & (tgt_owner >= 0)
    counts = torch.zeros(shape)
    counts.index_put_((tgt_owner[keep], src_owner[keep]), torch.ones(int(keep.sum())), accumulate=True)
    return counts


def overlap_matrix(
    src_offsets: list[tuple[int, int]], tgt_offsets: list[tuple[int, int]], text: str
) -> torch.Tensor:
    """Row-normalised character overlap ``[T_tgt, T_src]`` from two offset mappings of ``text``.

    Linear in the text length (one owner per character), so long chunks stay cheap. Rows with no overlap:
    zero when the target token is a leading empty-span token (before any text), else a one-hot on the
    nearest source token that starts at or before it.
    """
    shape = (len(tgt_offsets), len(src_offsets))
    if not src_offsets or not tgt_offsets:
        return torch.zeros(shape)
    n = max(len(text), max(e for _, e in src_offsets), max(e for _, e in tgt_offsets))
    src_owner, tgt_owner = _owners(src_offsets, n), _owners(tgt_offsets, n)
    visible = torch.tensor([not c.isspace() for c in text] + [True] * (n - len(text)), dtype=torch.bool)
    counts = _counts(src_owner, tgt_owner, visible, shape)
    whitespace_only = counts.sum(1) == 0
    if whitespace_only.any():
        counts[whitespace_only] = _counts(src_owner, tgt_owner, torch.ones_like(visible), shape)[whitespace_only]
    src_begin = torch.tensor([o[0] for o in src_offsets])
    src_has_text = torch.tensor([o[1] > o[0] for o in src_offsets])
    first_text = next((i for i, (b, e) in enumerate(tgt_offsets) if e > b), len(tgt_offsets))
    for t in torch.nonzero(counts.sum(1) == 0).flatten().tolist():
        b, e = tgt_offsets[t]
        if t < first_text:
            continue  # leading empty-span token (OPT's </s>): stays zero, computed natively by the target
        # No shared character: borrow the last source token with text that starts at or before this one.
        before = torch.nonzero(src_has_text & (src_begin <= b)).flatten()
        cand = before if before.numel() else torch.nonzero(src_has_text).flatten()
        if cand.numel():
            counts[t, int(cand[-1] if before.numel() else cand[0])] = 1.0
    total = counts.sum(1, keepdim=True)
    return torch.where(total > 0, counts / total.clamp_min(1e-12), counts)


def token_alignment(
    src_tokenizer, tgt_tokenizer, text: str, add_special_tokens: bool = True, src_special_tokens: bool | None = None
) -> Alignment:
    """Tokenize ``text`` for both models and build the target-by-source averaging matrix.

    Args:
        src_tokenizer: Source fast tokenizer.
        tgt_tokenizer: Target fast tokenizer.
        text: The context text (one chunk).
        add_special_tokens: Let the tokenizers add their specials (OPT's leading ``</s>``); pass ``False`` for
            chunks that continue a context.
        src_special_tokens: Override ``add_special_tokens`` for the source side only (e.g. a source chunk
            stored without specials, translated for a target whose ``</s>`` leads the context).

    Returns:
        :class:`Alignment` ``(src_ids, tgt_ids, W)``; ``W`` is the identity for identical tokenizers.
    """
    src_special = add_special_tokens if src_special_tokens is None else src_special_tokens
    src_ids, src_off = _encode(src_tokenizer, text, src_special)
    if src_special == add_special_tokens and same_tokenizer(src_tokenizer, tgt_tokenizer):
        return Alignment(src_ids, src_ids.clone(), torch.eye(len(src_ids)))
    tgt_ids, tgt_off = _encode(tgt_tokenizer, text, add_special_tokens)
    return Alignment(src_ids, tgt_ids, overlap_matrix(src_off, tgt_off, text))


def leading_unaligned(W: torch.Tensor) -> int:
    """Number of leading target rows with no source counterpart (the target computes them itself)."""
    empty = (W.abs().sum(1) == 0).tolist()
    n = 0
    while n < len(empty) and empty[n]:
        n += 1
    return n
