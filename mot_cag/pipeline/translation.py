"""Glue between context pieces and the translators: one piece's source KV -> the target's cache space."""

from __future__ import annotations

from pathlib import Path

import torch

from mot_cag.errors import MotCagError
from mot_cag.models.cache import KVChunk, Positioner
from mot_cag.models.registry import LoadedModel
from mot_cag.pipeline.context import Piece, TranslateFn


def same_model(a: LoadedModel, b: LoadedModel) -> bool:
    """Whether two loaded models are the same weights and tokenizer."""
    return a.fingerprint == b.fingerprint


def piece_translator(
    source: LoadedModel,
    target: LoadedModel,
    translator: str | Path | None = None,
    mode: str | None = None,
) -> TranslateFn:
    """A ``(piece, start) -> KVChunk`` function for :class:`~mot_cag.pipeline.context.TranslatedContext`.

    When source and target are the same model the stored chunks are used as they are (RoPE keys rotated to
    their place; absolute-position chunks keep the positions they were prefilled at, a measured mismatch).
    Otherwise the translator for the pair (``translator`` folder, or the one found for the names) maps the
    source KV onto the target's tokens of the piece's text.

    Args:
        source: Source model (weights not needed: ``load_model(..., weights=False)`` is enough).
        target: Target model (runs leading target-only tokens, and replay injection).
        translator: Translator folder; default: :func:`~mot_cag.translate.checkpoint.find_translator`.
        mode: ``direct`` or ``replay`` injection (default: the translator's own).
    """
    device = target.device
    if same_model(source, target):
        positioner = Positioner(target.layout, target.model.config)

        def as_is(piece: Piece, start: int) -> KVChunk:
            chunk = _source_kv(piece).to(device=device, dtype=torch.float32)
            if target.layout.positions == "rope":
                return positioner.reposition(chunk, start)
            return KVChunk(chunk.keys, chunk.values, start)

        return as_is

    from mot_cag.translate.alignment import token_alignment
    from mot_cag.translate.checkpoint import find_translator, load_translator
    from mot_cag.translate.inject import translate

    path = Path(translator) if translator else find_translator(source.name, target.name)
    tr = load_translator(path, source, target, device=device)

    @torch.no_grad()
    def translate_piece(piece: Piece, start: int) -> KVChunk:
        al = token_alignment(source.tokenizer, target.tokenizer, piece.text, add_special_tokens=False)
        src = _source_kv(piece).to(device=device, dtype=torch.float32)
        if src.length != len(al.src_ids):
            raise MotCagError(
                f"A stored chunk holds {src.length} source tokens but its text tokenizes to {len(al.src_ids)}; "
                "the store was made with another tokenizer: re-ingest it with this source model."
            )
        return translate(tr, src, al.W.to(device), target, al.tgt_ids.to(device), target_start=start, mode=mode)

    return translate_piece


def _source_kv(piece: Piece) -> KVChunk:
    if piece.source_kv is None:
        raise MotCagError("Translated mode needs the source model's cache of every chunk; ingest the documents "
                          "into a store first (`mot-cag ingest`).")
    return piece.source_kv()
