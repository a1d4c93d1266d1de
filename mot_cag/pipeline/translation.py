"""Glue between context pieces and the translators: one piece's source KV -> the target's cache space."""

from __future__ import annotations

from pathlib import Path

import torch

from mot_cag.errors import MotCagError
from mot_cag.models.cache import KVChunk
from mot_cag.models.positions import Positioner
from mot_cag.models.registry import LoadedModel
from mot_cag.names import INJECTIONS, choose
from mot_cag.pipeline.context import (
    LRU,
    ContextBuilder,
    Piece,
    Recompute,
    ReplayJointContext,
    TranslatedContext,
    TranslateFn,
    make_builder,
)
from mot_cag.prompts import prompt_format

AUTO_INJECTION = "replay-joint"
"""What ``auto`` means for translators of chunks prefilled alone (the zoo): on the held-out store corpora, replay
over the joined context keeps 0.99 of the context's effect (kl_benefit) for every zoo target, injecting all layers
0.81-0.94 (mot_cag/zoo/translators/RESULTS.md, "Over a store")."""

AUTO_INJECTION_PREFIXED = "inject-all"
"""What ``auto`` means for translators of chunks prefilled after the prompt head (the real models): every layer
translated, then the context's tail, where the most relevant chunk stands, re-read by the target over the translated
rest (the auto recompute). On held-out questions of the six real pairs it kept more of reading the text than
replay-joint, at a lower time to first token (docs/translators-real.md)."""


def auto_injection(translator) -> str:
    """The injection ``auto`` stands for with ``translator``: :data:`AUTO_INJECTION_PREFIXED` for one trained on
    prefixed chunks that covers every layer, else :data:`AUTO_INJECTION`."""
    cfg = translator.config
    return AUTO_INJECTION_PREFIXED if cfg.source_head and cfg.coverage == "inject-all" else AUTO_INJECTION


def same_model(a: LoadedModel, b: LoadedModel) -> bool:
    """Whether two loaded models are the same weights and tokenizer."""
    return a.fingerprint == b.fingerprint


def piece_translator(
    source: LoadedModel,
    target: LoadedModel,
    translator=None,
    injection: str | None = None,
    window_only: bool = False,
    separator: str = "",
) -> TranslateFn:
    """A ``(piece, start) -> KVChunk`` function for :class:`~mot_cag.pipeline.context.TranslatedContext`.

    When source and target are the same model the stored chunks are used as they are (RoPE keys rotated to
    their place; absolute-position chunks keep the positions they were prefilled at, a measured mismatch).
    Otherwise the translator for the pair (``translator`` folder, or the one found for the names) maps the
    source KV onto the target's tokens of the piece's text.

    Args:
        source: Source model (weights not needed: ``load_model(..., weights=False)`` is enough).
        target: Target model (runs leading target-only tokens, and replay injection).
        translator: Translator folder or loaded translator; default:
            :func:`~mot_cag.translate.checkpoint.find_translator`.
        injection: ``inject-all`` or ``replay`` (default: the translator's coverage).
        window_only: Return the translator's target layers untouched (:func:`~mot_cag.translate.inject.injected_kv`),
            for :class:`~mot_cag.pipeline.context.ReplayJointContext`; ``injection`` is then ignored.
        separator: Text after each piece's text in its stored chunk (a prefixed store's chunks hold text and the
            prompt's separator); source and target tokens are aligned over text + separator.
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
    from mot_cag.translate.inject import injected_kv, translate

    tr = _load(source, target, translator)

    @torch.no_grad()
    def translate_piece(piece: Piece, start: int) -> KVChunk:
        al = token_alignment(source.tokenizer, target.tokenizer, piece.text + separator, add_special_tokens=False)
        src = _source_kv(piece).to(device=device, dtype=torch.float32)
        if src.length != len(al.src_ids):
            raise MotCagError(
                f"A stored chunk holds {src.length} source tokens but its text tokenizes to {len(al.src_ids)} "
                f"{source.name} tokens; the store was made with another tokenizer or chunk prefix: re-ingest it with "
                "this source model."
            )
        W, ids = al.W.to(device), al.tgt_ids.to(device)
        if window_only:
            return injected_kv(tr, src, W, target, ids, target_start=start)
        return translate(tr, src, W, target, ids, target_start=start, injection=injection)

    return translate_piece


def _load(source: LoadedModel, target: LoadedModel, translator):
    """A loaded translator: ``translator`` itself when already loaded, else from its folder (or the pair's)."""
    from mot_cag.translate.checkpoint import find_translator, load_translator
    from mot_cag.translate.mot import Translator

    if isinstance(translator, Translator):
        return translator

    path = Path(translator) if translator else find_translator(source.name, target.name)
    return load_translator(path, source, target, device=target.device)


def translated_builder(
    source: LoadedModel,
    target: LoadedModel,
    translator: str | Path | None = None,
    injection: str = "auto",
    cache: LRU | None = None,
    recompute: Recompute | None = None,
    chunk_prefix: tuple[int, ...] | None = None,
    window: float | None = None,
) -> TranslatedContext:
    """The ``translated`` context builder of a pair with the chosen injection.

    Args:
        source: Source model (weights not needed).
        target: Target model.
        translator: Translator folder (default: the one found for the pair).
        injection: ``inject-all`` (translated K/V are the cache; old spelling ``direct``), ``replay`` (each piece
            replayed by the target), ``replay-joint`` (one replay over all pieces), or ``auto``
            (:func:`auto_injection`). Ignored when the target is the source model (its stored caches are used as
            they are).
        cache: LRU of translated pieces (shared across builders of one target, optional).
        recompute: Cross-chunk repair applied to the assembled context (default auto: the tail recompute for a
            model's own prefixed chunks, 0.35, and for inject-all over another model's prefixed chunks, 0.5; none
            otherwise).
        chunk_prefix: The prefix ids the store's chunks were prefilled after (:attr:`~mot_cag.store.store.
            StoreConfig.prefix_ids`; empty: none), when known. With the source as target, a non-empty prefix
            must be the target's prompt head, whose KV then stands once before the stored chunks.
        window: Replay-joint only: the share of the target's layers, from the top, that take translated K/V
            (the target computes the layers below over the joined context, so the pass costs about
            ``1 - window`` of a prefill). Default: the translator's own window. A translator trained to
            inject all layers covers every layer, so any window from 0 to 1 can be chosen at question time.

    Raises:
        MotCagError: Unknown injection; a store prefilled after another prompt head than the target's;
            TranslatorError: a translator that cannot inject that way.
    """
    injection = choose("injection", injection, INJECTIONS)
    if same_model(source, target):
        # A prefixed store's chunks are the text and the prompt's separator, prefilled after the head
        # (mot_cag.ingest.run); a prefix-free one holds the text alone.
        prefixed = None if chunk_prefix is None else bool(chunk_prefix)
        builder = TranslatedContext(target, piece_translator(source, target), cache, recompute, prefixed=prefixed,
                                    separated=bool(chunk_prefix))
        if chunk_prefix and tuple(chunk_prefix) != tuple(builder.head):
            raise MotCagError(f"This store's chunks were prefilled after another prompt head than {target.name}'s "
                              "current one (its chat template or instruction changed); ingest the documents into a "
                              "new store.")
        return builder
    from mot_cag.translate.inject import check_injection

    tr = _load(source, target, translator)
    injection = check_injection(tr, auto_injection(tr) if injection == "auto" else injection)
    prefixed = check_translator_prefix(tr, target, chunk_prefix)
    # The auto repair (the tail re-read by the target) was measured on prefixed chunks whose every layer is
    # translated; a replay already recomputes the layers below its window across chunks, so it gets none unless asked.
    recompute = (recompute or Recompute()).resolved(prefixed and injection == "inject-all", translated=True)
    # A prefixed translator maps chunks made after the source's head (text + separator) onto the target's
    # chunks made after its own head, which stands once at the front of the context.
    sep = prompt_format(target).separator if prefixed else ""
    if injection == "replay-joint":
        lm = tr.config.layers
        layers = [lm.target_layers[i] for i in lm.window_positions()]
        if window is not None:
            layers = replay_window(tr, window)
        fn = piece_translator(source, target, translator=tr, window_only=True, separator=sep)
        builder: TranslatedContext = ReplayJointContext(target, fn, list(lm.target_layers), layers, cache, recompute,
                                                        prefixed=prefixed)
    else:
        builder = TranslatedContext(target, piece_translator(source, target, translator=tr, injection=injection,
                                                                     separator=sep),
                                    cache, recompute, prefixed=prefixed)
    builder.separated = prefixed
    return builder


def builder_for(mode: str, target: LoadedModel, recompute: Recompute | None = None, source: LoadedModel | None = None,
                translator: str | Path | None = None, injection: str = "auto", chunk_prefix: tuple[int, ...] = (),
                replay_window: float | str | None = "auto") -> ContextBuilder:
    """The context builder of a mode: :func:`translated_builder` for ``translated`` (which needs ``source``),
    :func:`~mot_cag.pipeline.context.make_builder` for the others. ``ask`` and ``eval`` both build here."""
    if mode != "translated":
        return make_builder(mode, target, recompute=recompute)
    if source is None:
        raise MotCagError("Mode 'translated' needs a source model: pass --source NAME (the model that prefilled).")
    return translated_builder(source, target, translator, injection, recompute=recompute, chunk_prefix=chunk_prefix,
                              window=window_share(replay_window))


def window_share(value: float | str | None) -> float | None:
    """A validated replay window setting as :func:`translated_builder` takes it (``auto`` -> ``None``)."""
    from mot_cag.config import parse_window

    share = parse_window(value)
    return None if share == "auto" else float(share)


def replay_window(tr, share: float) -> list[int]:
    """The top ``share`` of the target's layers (at least one), checked against the layers ``tr`` translates."""
    if not 0 < share <= 1:
        raise MotCagError(f"The replay window is a share of the target's layers in (0, 1], got {share}.")
    total = tr.config.tgt.layers
    width = max(1, round(share * total))
    layers = list(range(total - width, total))
    if not set(layers) <= set(tr.config.layers.target_layers):
        lm = tr.config.layers
        raise MotCagError(f"Translator {tr.config.source} -> {tr.config.target} covers target layers "
                          f"{lm.window_start}..{lm.window_start + lm.window_width - 1} only; a window of {share} needs "
                          f"{layers[0]}..{total - 1}. Use a translator trained to inject all layers "
                          "(`--injection inject-all`).")
    return layers


def check_translator_prefix(tr, target: LoadedModel, chunk_prefix: tuple[int, ...] | None) -> bool:
    """Whether the translator reads prefixed chunks; a clear error when the store's chunks or the target's
    prompt head are not the ones it was trained on.

    Args:
        tr: The loaded translator.
        target: The target model.
        chunk_prefix: The store's prefix ids (empty: chunks prefilled alone; ``None``: not known, the
            translator's own is assumed).
    """
    cfg = tr.config
    prefixed = bool(cfg.source_head)
    pair = f"{cfg.source} -> {cfg.target}"
    if chunk_prefix is not None and bool(chunk_prefix) != prefixed:
        how = "after the source's prompt head" if chunk_prefix else "alone"
        trained = "after the prompt head" if prefixed else "alone"
        fix = "prompt" if chunk_prefix else "none"
        raise MotCagError(f"This store's chunks were prefilled {how}, but translator {pair} was trained on chunks "
                          f"prefilled {trained}; train one for such stores (`mot-cag train --source {cfg.source} "
                          f"--target {cfg.target} --chunk-prefix {fix}`) or ingest into a new store with "
                          f"--chunk-prefix {'none' if chunk_prefix else 'prompt'}.")
    if prefixed and chunk_prefix and tuple(chunk_prefix) != tuple(cfg.source_head):
        raise MotCagError(f"This store's chunks were prefilled after another prompt head than translator {pair} was "
                          "trained on (the source's chat template or instruction changed); retrain the translator "
                          "or ingest into a new store.")
    if prefixed and tuple(prompt_format(target).head) != tuple(cfg.target_head):
        raise MotCagError(f"{target.name}'s prompt head differs from the one translator {pair} was trained after "
                          "(its chat template or instruction changed); retrain the translator.")
    return prefixed


def _source_kv(piece: Piece) -> KVChunk:
    if piece.source_kv is None:
        raise MotCagError("Translated mode needs the source model's cache of every chunk; ingest the documents "
                          "into a store first (`mot-cag ingest`).")
    return piece.source_kv()
