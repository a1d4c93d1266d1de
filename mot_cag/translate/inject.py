"""Translate a source :class:`KVChunk` into a target's cache: alignment, positions, layers, injection.

Position handling:

* RoPE sources: keys are un-rotated (rotated by ``-position``) before translation, so the translator sees
  position-free keys. RoPE targets: the translator emits un-rotated keys that are rotated to their global
  positions ``target_start + i`` here, so one translation can be placed anywhere exactly.
* Absolute-position targets (GPT-2, OPT): positions live in every layer's K/V, so the translator is told the
  target positions (sinusoidal features) and replay runs the target at the global positions.

Injection:

* ``direct``: the translator's output for every target layer is the cache; the target never runs over the
  context (it only computes leading target-only tokens such as OPT's ``</s>``, whose KV is context-free).
* ``replay`` (the paper's): the target re-runs over the context tokens with translated K/V substituted in the
  window layers and returns its own recomputed cache.
* ``replay-joint``: the same replay, run once over all retrieved chunks together (assembled by
  :mod:`mot_cag.pipeline.context`), so the re-run layers also attend across chunks.
"""

from __future__ import annotations

import torch

from mot_cag.errors import TranslatorError
from mot_cag.models.cache import KVChunk, forward, replay_forward
from mot_cag.models.positions import rotate_keys
from mot_cag.names import INJECTIONS, choose
from mot_cag.translate.alignment import leading_unaligned
from mot_cag.translate.mot import Translator


def _unrotate(keys: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``(L, H, T, D)`` keys rotated at ``start + i`` -> as if at position 0."""
    pos = torch.arange(start, start + keys.shape[2], device=keys.device)
    return rotate_keys(keys, -pos, inv_freq)


def _rotate(keys: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(start, start + keys.shape[2], device=keys.device)
    return rotate_keys(keys, pos, inv_freq)


def source_window(translator: Translator, chunk: KVChunk, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Source K/V of the mapped layers, position-free and averaged onto target tokens.

    Returns:
        ``(keys, values)``, each ``(n, T_tgt, W_src)``.
    """
    cfg = translator.config
    src = cfg.src
    if (chunk.keys.shape[0], chunk.keys.shape[1], chunk.keys.shape[3]) != (src.layers, src.kv_heads, src.head_dim):
        raise TranslatorError(
            f"This chunk's layout {tuple(chunk.keys.shape)} is not the translator's source '{cfg.source}' "
            f"({src.layers} layers, {src.kv_heads} kv heads, head dim {src.head_dim}); use a translator trained "
            f"for the model that made the chunk (`mot-cag train --source MODEL --target {cfg.target}`)."
        )
    if W.shape[1] != chunk.length:
        raise ValueError(f"alignment has {W.shape[1]} source columns but the chunk has {chunk.length} tokens")
    chunk = chunk.to(device=translator.device, dtype=translator.dtype)
    layers = torch.tensor(cfg.layers.source_layers, device=chunk.keys.device)
    keys, values = chunk.keys[layers], chunk.values[layers]  # (n, H, T_src, D)
    if src.positions == "rope":
        keys = _unrotate(keys, chunk.start, translator.src_inv_freq)
    n, h, t, d = keys.shape
    W = W.to(device=keys.device, dtype=keys.dtype)
    flat_k = keys.permute(0, 2, 1, 3).reshape(n, t, h * d)  # (n, T_src, H*D)
    flat_v = values.permute(0, 2, 1, 3).reshape(n, t, h * d)
    return torch.einsum("us,nsw->nuw", W, flat_k), torch.einsum("us,nsw->nuw", W, flat_v)  # (n, T_tgt, W_src)


def target_embeddings(translator: Translator, model, tgt_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``(T, E)`` target input embeddings of ``tgt_ids`` when the translator reads them, else ``None``."""
    if not translator.config.token_features or tgt_ids is None or model is None:
        return None
    emb = model.get_input_embeddings()
    with torch.no_grad():
        return emb(tgt_ids.view(-1).to(emb.weight.device))


def translated_window(
    translator: Translator, chunk: KVChunk, W: torch.Tensor, target_start: int = 0,
    embeddings: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Translated K/V of the translator's target layers, keys rotated to ``target_start + i`` (RoPE targets).

    Args:
        translator: The translator.
        chunk: Source chunk.
        W: ``[T_tgt, T_src]`` alignment (rows to translate).
        target_start: Position of the first row.
        embeddings: ``(T_tgt, E)`` target embeddings of those rows (translators with ``token_features``).

    Returns:
        ``(keys, values)``, each ``(n, H_tgt, T_tgt, D_tgt)``.
    """
    tgt = translator.config.tgt
    xk, xv = source_window(translator, chunk, W)
    positions = torch.arange(target_start, target_start + W.shape[0], device=xk.device)
    yk, yv = translator(xk, xv, positions, embeddings)  # (n, T, H_tgt*D_tgt)
    n, t, _ = yk.shape
    keys = yk.view(n, t, tgt.kv_heads, tgt.head_dim).permute(0, 2, 1, 3)  # (n, H, T, D)
    values = yv.view(n, t, tgt.kv_heads, tgt.head_dim).permute(0, 2, 1, 3)
    if tgt.positions == "rope":
        keys = _rotate(keys, target_start, translator.tgt_inv_freq)
    return keys, values


def injected_kv(
    translator: Translator,
    source_chunk: KVChunk,
    W: torch.Tensor,
    target_lm,
    tgt_ids: torch.Tensor,
    target_start: int = 0,
) -> KVChunk:
    """Translated K/V of the translator's target layers (``config.layers.target_layers``) for ``tgt_ids``.

    Leading target-only tokens (OPT's ``</s>``) get the target's own K/V, which is context-free and exact.
    For a direct translator the chunk covers every target layer and is a complete cache; for a replay
    translator it covers the window layers only.

    Returns:
        A :class:`KVChunk` ``[len(target_layers), H_tgt, T_tgt, D_tgt]`` at ``start=target_start``.
    """
    cfg = translator.config
    model = getattr(target_lm, "model", target_lm)
    tgt_ids = tgt_ids.view(-1)
    if W.shape[0] != tgt_ids.shape[0]:
        raise ValueError(f"alignment has {W.shape[0]} target rows but {tgt_ids.shape[0]} target ids were given")
    native = leading_unaligned(W)
    # Only rows with source text are translated; the translator sees the chunk from its first text token.
    emb = target_embeddings(translator, model, tgt_ids[native:])
    keys, values = translated_window(translator, source_chunk, W[native:], target_start + native, emb)  # (n,H,T,D)
    if native:
        with torch.no_grad():
            _, head = forward(model, tgt_ids[:native], None, start=target_start)
        idx = torch.tensor(cfg.layers.target_layers, device=head.keys.device)
        head_k = head.keys[idx].to(device=keys.device, dtype=keys.dtype)
        head_v = head.values[idx].to(device=keys.device, dtype=keys.dtype)
        keys = torch.cat([head_k, keys], dim=2)  # (n, H, T, D)
        values = torch.cat([head_v, values], dim=2)
    return KVChunk(keys, values, target_start)


def window_substitutes(translator: Translator, chunk: KVChunk) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{target layer: (keys, values)}`` of the replay window, from a chunk of :func:`injected_kv`'s layers.

    Each tensor is ``[H_tgt, T, D_tgt]``, ready for :func:`~mot_cag.models.cache.replay_forward`.
    """
    lm = translator.config.layers
    return {lm.target_layers[i]: (chunk.keys[i], chunk.values[i]) for i in lm.window_positions()}


def translate(
    translator: Translator,
    source_chunk: KVChunk,
    W: torch.Tensor,
    target_lm,
    tgt_ids: torch.Tensor,
    target_start: int = 0,
    injection: str | None = None,
) -> KVChunk:
    """Translate a source chunk into the target's cache for ``tgt_ids`` at positions ``target_start..``.

    Differentiable in the translator's parameters when called without ``torch.no_grad`` (training uses it).

    Args:
        translator: A translator for (source, target).
        source_chunk: Source KV ``[L_src, H_src, T_src, D_src]`` (any ``start``).
        W: ``[T_tgt, T_src]`` alignment from :func:`~mot_cag.translate.alignment.token_alignment`.
        target_lm: The target :class:`~mot_cag.models.registry.LoadedModel` (or a bare HF model): runs the
            leading target-only tokens, and the whole context in replay mode.
        tgt_ids: ``[T_tgt]`` target token ids of the same text.
        target_start: Global position of the first target token.
        injection: ``inject-all`` or ``replay``; defaults to the translator's coverage.

    Returns:
        A :class:`KVChunk` in the target's layout, ``start=target_start``, covering ``tgt_ids``.

    Raises:
        TranslatorError: A replay-only translator asked to inject all layers, or a chunk of another model.
    """
    injection = check_injection(translator, injection or translator.config.coverage)
    if injection == "replay-joint":
        raise TranslatorError("replay-joint injection runs over a whole context, not one chunk; use "
                              "mot_cag.pipeline.translation.translated_builder.")
    chunk = injected_kv(translator, source_chunk, W, target_lm, tgt_ids, target_start)
    if injection == "inject-all":
        return chunk
    model = getattr(target_lm, "model", target_lm)
    _, replayed = replay_forward(model, tgt_ids.view(-1), window_substitutes(translator, chunk), start=target_start,
                                 need_logits=False)
    return replayed


def check_injection(translator: Translator, injection: str) -> str:
    """``injection`` (``inject-all``, ``replay``, ``replay-joint``; old spelling ``direct``) when ``translator``
    can inject that way; a clear error otherwise."""
    cfg = translator.config
    injection = choose("injection", injection, tuple(i for i in INJECTIONS if i != "auto"), TranslatorError)
    if injection == "inject-all" and cfg.coverage == "replay":
        raise TranslatorError(
            f"Translator {cfg.source} -> {cfg.target} was trained for replay (window layers only) and cannot "
            "inject all layers; use --injection replay or train one with `mot-cag train --injection inject-all`."
        )
    return injection
