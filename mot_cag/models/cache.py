"""The one module that touches the transformers cache API.

transformers 5.24: models take ``cache=`` (``past_key_values`` is deprecated), a forward pass mutates the cache
in place, and ``DynamicCache.layers[i].keys/.values`` are ``[batch, kv_heads, seq, head_dim]``. Everything else in
mot-cag works with :class:`KVChunk`, a plain pair of stacked tensors, and converts here.

Position convention of a chunk: the chunk records ``start``, the global position of its first token. RoPE keys
are stored rotated as computed at ``start .. start+seq-1`` and can be moved exactly by rotating them by the
position delta (rotations compose). Absolute-position families (GPT-2, OPT) bake positions into every layer's
K/V, so their chunks cannot be moved: :meth:`mot_cag.models.positions.Positioner.reposition` refuses instead of
producing a wrong cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from mot_cag.errors import MotCagError
from mot_cag.models.layout import KVLayout


@dataclass
class KVChunk:
    """KV tensors of a run of tokens, all layers stacked.

    Attributes:
        keys: ``[layers, kv_heads, seq, head_dim]``.
        values: ``[layers, kv_heads, seq, head_dim]``.
        start: Global position of the first token (RoPE keys are rotated for ``start + i``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                "KVChunk keys and values must both be [layers, kv_heads, seq, head_dim]; got "
                f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}."
            )

    @property
    def length(self) -> int:
        """Number of tokens."""
        return int(self.keys.shape[2])

    @property
    def end(self) -> int:
        """Position just after the last token."""
        return self.start + self.length

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVChunk:
        """Copy to another device/dtype."""
        return replace(self, keys=self.keys.to(device=device, dtype=dtype),
                       values=self.values.to(device=device, dtype=dtype))

    def slice(self, begin: int, end: int) -> KVChunk:
        """Tokens ``begin:end`` (chunk-relative) as a new chunk with the matching start."""
        return KVChunk(self.keys[:, :, begin:end], self.values[:, :, begin:end], self.start + begin)


def check_layout(chunk: KVChunk, layout: KVLayout) -> None:
    """Raise a clear error when a chunk does not fit a model's cache layout."""
    want = (layout.layers, layout.kv_heads, layout.head_dim)
    got = (chunk.keys.shape[0], chunk.keys.shape[1], chunk.keys.shape[3])
    if want != got:
        raise MotCagError(
            f"This KV chunk has (layers, kv_heads, head_dim) = {got} but the model expects {want}; "
            "it was made by another model: translate it or re-ingest with this model."
        )


# --------------------------------------------------------------------------------------------- conversion


def to_dynamic_cache(chunk: KVChunk | None, config=None) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``chunk`` (batch 1). A forward pass will append to it in place.

    The cache is built without the model config on purpose: with it, transformers makes sliding-window
    layers (Gemma3) that keep only the last window of positions, so their layers would differ in length and a
    chunk could not be read back. Full layers hold every position; the model's own sliding-window mask still
    limits what those layers attend to, so logits equal a single pass (tests/test_cache.py). ``config`` is
    accepted for callers that pass it and is unused.
    """
    del config
    cache = DynamicCache()
    if chunk is not None and chunk.length > 0:
        for layer in range(chunk.keys.shape[0]):
            # (L, H, T, D)[layer] -> (1, H, T, D)
            cache.update(chunk.keys[layer].unsqueeze(0), chunk.values[layer].unsqueeze(0), layer)
    return cache


def from_dynamic_cache(cache: DynamicCache, start: int = 0, begin: int = 0) -> KVChunk:
    """Stack a batch-1 cache's layers into a chunk, keeping tokens from ``begin`` on."""
    keys = torch.stack([layer.keys[0, :, begin:] for layer in cache.layers])  # (L, H, T, D)
    values = torch.stack([layer.values[0, :, begin:] for layer in cache.layers])
    return KVChunk(keys, values, start + begin)


def empty_chunk(layout: KVLayout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> KVChunk:
    """A zero-length chunk of the right shape (the ``none`` context)."""
    shape = (layout.layers, layout.kv_heads, 0, layout.head_dim)
    return KVChunk(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))


# ----------------------------------------------------------------------------------------------- forward


def _position_ids(start: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device).unsqueeze(0)  # (1, n)


def forward(
    model,
    input_ids: torch.Tensor,
    context: KVChunk | None = None,
    *,
    start: int | None = None,
    keep_cache: bool = True,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, KVChunk | None]:
    """Run ``input_ids`` after a context cache.

    Args:
        model: A Hugging Face causal LM.
        input_ids: ``[seq]`` or ``[1, seq]`` token ids.
        context: KV of the tokens before ``input_ids`` (not modified), or ``None``.
        start: Global position of ``input_ids[0]``; defaults to ``context.end`` (or 0).
        keep_cache: Return the extended cache (context + new tokens) as a chunk.
        logits_to_keep: Compute logits for the last this many tokens only (0: all). A prefill needs none of
            them, and with a 262k vocabulary (Gemma3) the LM head over every token costs more than the layers.

    Returns:
        ``(logits [seq, vocab], cache)``; ``cache`` covers the context and the new tokens.
    """
    ids = input_ids.view(1, -1).to(model.device)
    if start is None:
        start = context.end if context is not None else 0
    past = context.length if context is not None else 0
    cache = to_dynamic_cache(context, model.config)
    # OPT derives positions from the mask when none are given, so always pass both explicitly.
    mask = torch.ones(1, past + ids.shape[1], dtype=torch.long, device=ids.device)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=_position_ids(start, ids.shape[1], ids.device),
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    chunk = None
    if keep_cache:
        # The forward pass appended the new tokens to ``cache`` in place.
        chunk = from_dynamic_cache(cache, start=context.start if context is not None else start)
    return out.logits[0], chunk


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, start: int = 0) -> KVChunk:
    """Prefill ``input_ids`` at positions ``start..`` and return their KV as a chunk."""
    _, chunk = forward(model, input_ids, None, start=start, logits_to_keep=1)
    assert chunk is not None
    return chunk


@torch.no_grad()
def prefill_after(model, input_ids: torch.Tensor, prefix: KVChunk | None) -> KVChunk:
    """Prefill ``input_ids`` right after ``prefix`` (attending to it) and return only their own KV.

    This is how a chunk is made to look as it will be read: after the same prompt head it will follow at
    question time (Block-Attention / TurboRAG style). The result starts at ``prefix.end`` (0 without a prefix);
    the prefix's own rows are dropped.
    """
    if prefix is None or prefix.length == 0:
        return prefill(model, input_ids, start=0 if prefix is None else prefix.end)
    _, chunk = forward(model, input_ids, prefix, logits_to_keep=1)
    assert chunk is not None
    return chunk.slice(prefix.length, chunk.length)


def join(chunks: Sequence[KVChunk]) -> KVChunk:
    """Concatenate chunks that are already at consecutive positions."""
    for a, b in zip(chunks, chunks[1:], strict=False):
        if a.end != b.start:
            raise ValueError(f"chunks are not contiguous: one ends at {a.end}, the next starts at {b.start}")
    keys = torch.cat([c.keys for c in chunks], dim=2)  # (L, H, sum T, D)
    values = torch.cat([c.values for c in chunks], dim=2)
    return KVChunk(keys, values, chunks[0].start)


# ------------------------------------------------------------------------------------------- generation


@torch.no_grad()
def greedy_tokens(
    model,
    prompt_ids: torch.Tensor,
    context: KVChunk | None,
    max_new_tokens: int,
    stop: Callable[[list[int]], bool] | None = None,
    eos_token_id: int | None = None,
    ban_first: Sequence[int] = (),
) -> Iterator[int]:
    """Greedily decode after ``context`` + ``prompt_ids``, yielding each new token id as it is chosen.

    Args:
        model: Causal LM.
        prompt_ids: ``[seq]`` ids that follow the context (at least one).
        context: Cached context, or ``None``.
        max_new_tokens: Upper bound on generated tokens.
        stop: Called with the generated ids so far; ``True`` ends decoding (after yielding that token).
        eos_token_id: Ends decoding when produced (not yielded).
        ban_first: Token ids the first generated token may not be.
    """
    limit = model.config.max_position_embeddings if hasattr(model.config, "max_position_embeddings") else None
    limit = limit or getattr(model.config, "n_positions", None)
    out: list[int] = []
    # One cache for the whole decode: the context is copied into it once, the prompt and each token appended.
    dyn = to_dynamic_cache(context)
    ids = prompt_ids.view(1, -1).to(model.device)
    first = context.end if context is not None else 0
    base = context.start if context is not None else first  # position of the cache's first row
    mask = torch.ones(1, first - base + ids.shape[1], dtype=torch.long, device=model.device)
    step = model(input_ids=ids, attention_mask=mask, position_ids=_position_ids(first, ids.shape[1], model.device),
                 cache=dyn, use_cache=True, logits_to_keep=1)
    pos = first + ids.shape[1]
    logits = step.logits[0, -1]
    if ban_first:
        logits = logits.clone()
        logits[list(ban_first)] = float("-inf")
    next_id = int(logits.argmax())
    for _ in range(max_new_tokens):
        if eos_token_id is not None and next_id == eos_token_id:
            return
        out.append(next_id)
        yield next_id
        if (stop is not None and stop(out)) or (limit is not None and pos >= limit):
            return
        ids = torch.tensor([[next_id]], device=model.device)
        mask = torch.ones(1, pos - base + 1, dtype=torch.long, device=model.device)
        step = model(input_ids=ids, attention_mask=mask, position_ids=_position_ids(pos, 1, model.device),
                     cache=dyn, use_cache=True)
        pos += 1
        next_id = int(step.logits[0, -1].argmax())


# ------------------------------------------------------------------------------- replay with substitution
# Used by the translators' replay injection (mot_cag.translate.inject): the target re-runs over the context
# while chosen layers read translated K/V instead of the K/V the target computes itself.


class _SubstitutingCache(DynamicCache):
    """A ``DynamicCache`` that, on the first update of chosen layers, stores given K/V instead of the new ones.

    Attention layers call ``cache.update(new_k, new_v, layer)`` and attend over what it returns, so swapping
    the tensors here makes that layer (and every layer above it) run on the substituted K/V. Substitutes
    keep their autograd history, which lets translators train through the replay.
    """

    def __init__(self, config, substitute: dict[int, tuple[torch.Tensor, torch.Tensor]], exit_at: int | None = None):
        super().__init__()  # full layers for every layer type (see to_dynamic_cache)
        self._substitute = dict(substitute)
        self._exit_at = exit_at

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == self._exit_at:
            # Every layer from here up is substituted: their K/V are known, so the rest of the pass (and the
            # LM head) would compute nothing that is kept. Store them all and stop.
            for i in sorted(self._substitute):
                k, v = self._substitute[i]
                super().update(k.to(key_states.dtype), v.to(value_states.dtype), i, *args, **kwargs)
            self._substitute.clear()
            raise _StopReplay
        sub = self._substitute.pop(layer_idx, None)
        if sub is not None:
            k, v = sub
            if k.shape != key_states.shape or v.shape != value_states.shape:
                raise ValueError(
                    f"substitute K/V for layer {layer_idx} have shape {tuple(k.shape)} but the model computed "
                    f"{tuple(key_states.shape)}"
                )
            key_states, value_states = k.to(key_states.dtype), v.to(value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _StopReplay(Exception):
    """Raised inside a replay once every remaining layer's K/V is substituted (see ``need_logits``)."""


def replay_forward(
    model,
    input_ids: torch.Tensor,
    substitute: dict[int, tuple[torch.Tensor, torch.Tensor]],
    *,
    start: int = 0,
    need_logits: bool = True,
) -> tuple[torch.Tensor | None, KVChunk]:
    """Run ``input_ids`` (no prior context) with some layers' K/V replaced, and return the resulting cache.

    Args:
        model: A Hugging Face causal LM.
        input_ids: ``[seq]`` token ids.
        substitute: ``{layer: (keys, values)}``, each ``[kv_heads, seq, head_dim]`` exactly as the layer would
            cache them (RoPE keys rotated at ``start..``).
        start: Global position of ``input_ids[0]``.
        need_logits: With ``False``, when the substituted layers are all the layers from some layer up (a
            top-aligned window), the pass stops at that layer: nothing above it changes the cache, so the
            cache is the same and the layers above and the LM head are not paid for. Logits are then ``None``.

    Returns:
        ``(logits [seq, vocab] or None, chunk)``: the chunk holds the substituted K/V in the chosen layers and
        the target's own recomputed K/V elsewhere.
    """
    ids = input_ids.view(1, -1).to(model.device)
    layers = model.config.get_text_config().num_hidden_layers
    exit_at = None
    if not need_logits and substitute and set(substitute) == set(range(min(substitute), layers)):
        exit_at = min(substitute)
    # (H, T, D) -> (1, H, T, D)
    cache = _SubstitutingCache(model.config, {i: (k.unsqueeze(0), v.unsqueeze(0)) for i, (k, v) in substitute.items()},
                               exit_at)
    mask = torch.ones(1, ids.shape[1], dtype=torch.long, device=ids.device)
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=_position_ids(start, ids.shape[1], ids.device),
                    cache=cache, use_cache=True, logits_to_keep=0 if need_logits else 1)
        logits = out.logits[0] if need_logits else None
    except _StopReplay:
        logits = None
    return logits, from_dynamic_cache(cache, start=start)


# ------------------------------------------------------------------------ selective recompute (CacheBlend)
# Chunks prefilled separately and joined miss cross-chunk attention. CacheBlend repairs a joined cache by
# recomputing the K/V of a few tokens against the whole joined cache; mot_cag.models.recompute chooses them.

#: Attention implementations known to apply a user-given 4D additive mask as is (flash kernels ignore it).
_CUSTOM_MASK_ATTENTION = ("sdpa", "eager")


def _selected_rows(indices: Sequence[int] | torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``indices`` as a sorted ``[n_sel]`` long tensor without duplicates, checked against ``n_tokens``."""
    sel = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
    sel = torch.unique(sel)  # sorted, duplicates removed
    if sel.numel() and (int(sel[0]) < 0 or int(sel[-1]) >= n_tokens):
        bad = [i for i in sel.tolist() if not 0 <= i < n_tokens]
        raise ValueError(
            f"recompute indices {bad[:5]} are out of range for a chunk of {n_tokens} tokens; indices are "
            f"chunk-relative and must lie in [0, {n_tokens})."
        )
    return sel


def _recompute_mask(sel: torch.Tensor, n_tokens: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive 4D mask ``[1, 1, n_sel, n_tokens + n_sel]`` for the selected tokens' queries.

    Key columns are the chunk's ``n_tokens`` cached entries followed by the ``n_sel`` freshly computed ones
    (a forward pass appends the new K/V to the cache before attending). A selected query at position ``p``
    sees cached entries at positions ``<= p`` except the selected ones (stale: their fresh versions replace
    them) and fresh entries of selected tokens at positions ``<= p``. 0 = attend, ``finfo.min`` = hidden;
    additive rather than bool because eager attention adds the mask to the scores. With ``window`` (a
    sliding-window layer) a query at ``p`` also only sees positions ``> p - window``, as in transformers.
    """
    query = sel[:, None]  # (S, 1)
    stale = torch.zeros(n_tokens, dtype=torch.bool, device=sel.device)
    stale[sel] = True
    cols = torch.arange(n_tokens, device=sel.device)[None, :]  # (1, T)
    past = (cols <= query) & ~stale[None, :]  # (S, T)
    fresh = sel[None, :] <= query  # (S, S)
    if window is not None:
        past &= cols > query - window
        fresh &= sel[None, :] > query - window
    allowed = torch.cat([past, fresh], dim=1)  # (S, T + S)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sel.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape)


@torch.no_grad()
def selective_recompute(
    model,
    chunk: KVChunk,
    input_ids: torch.Tensor,
    indices: Sequence[int] | torch.Tensor,
) -> KVChunk:
    """Recompute the K/V of chosen tokens of a (joined) chunk against the whole chunk, in every layer.

    Each selected token's query attends to every earlier token (unselected: its K/V from ``chunk``;
    selected: its recomputed K/V) and to itself: exactly what a single-pass prefill would give if every
    unselected token's K/V were the given ones. Selecting all tokens therefore equals a fresh prefill. Costs
    one forward pass of the selected tokens over ``chunk.length + n_sel`` keys.

    Args:
        model: A Hugging Face causal LM with ``sdpa`` or ``eager`` attention (custom masks).
        chunk: KV of ``input_ids`` (same length), ``chunk.start`` = global position of ``input_ids[0]``; on the
            model's device. Not modified.
        input_ids: ``[seq]`` or ``[1, seq]`` token ids the chunk covers.
        indices: Chunk-relative token indices to recompute; sorted and de-duplicated here.

    Returns:
        A new chunk of the same shape and start: recomputed rows at ``indices``, the others bit-for-bit
        copies of ``chunk``'s.

    Raises:
        ValueError: ``input_ids`` and ``chunk`` differ in length, or an index is out of range.
        MotCagError: The model's attention implementation ignores custom masks.
    """
    ids = input_ids.reshape(-1)
    n_tokens = chunk.length
    if ids.shape[0] != n_tokens:
        raise ValueError(f"input_ids has {ids.shape[0]} tokens but the chunk covers {n_tokens}; pass the ids the "
                         "chunk was prefilled from.")
    sel = _selected_rows(indices, n_tokens)
    if sel.numel() == 0:
        return KVChunk(chunk.keys.clone(), chunk.values.clone(), chunk.start)
    head = n_tokens - sel.numel()
    if int(sel[0]) == head:
        # A contiguous tail (policy ``end``) is a plain prefill after the rows before it: the causal kernel, no
        # stale rows to mask, the same K/V (about 15% faster than the masked pass on a 0.5B model at 2k tokens).
        _, out = forward(model, ids[head:], chunk.slice(0, head) if head else None, start=chunk.start + head,
                         logits_to_keep=1)
        assert out is not None
        return out.to(chunk.keys.device, chunk.keys.dtype)
    return _masked_recompute(model, chunk, ids, sel)


def _masked_recompute(model, chunk: KVChunk, ids: torch.Tensor, sel: torch.Tensor) -> KVChunk:
    """:func:`selective_recompute` of any selection ``sel`` (sorted, unique rows): one pass of the selected tokens
    over the whole chunk with a mask that hides their own stale rows."""
    n_tokens = chunk.length
    keys, values = chunk.keys.clone(), chunk.values.clone()
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in _CUSTOM_MASK_ATTENTION:
        raise MotCagError(
            f"Selective recompute needs custom attention masks, which '{attn}' attention ignores; load the model "
            f"with attn_implementation set to one of {', '.join(_CUSTOM_MASK_ATTENTION)}."
        )
    device = model.device
    sel_dev = sel.to(device)
    cache = to_dynamic_cache(chunk, model.config)
    mask = _recompute_mask(sel_dev, n_tokens, model.dtype)
    layer_types = getattr(model.config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        # Models with mixed layer types (Gemma3) take one mask per type.
        window = int(model.config.sliding_window)
        mask = {"full_attention": mask,
                "sliding_attention": _recompute_mask(sel_dev, n_tokens, model.dtype, window)}
    model(
        input_ids=ids.to(device)[sel_dev].view(1, -1),  # (1, S)
        attention_mask=mask,
        # Explicit global positions: OPT would otherwise derive them from the (here 4D) mask.
        position_ids=(chunk.start + sel_dev).view(1, -1),  # (1, S)
        cache=cache,
        use_cache=True,
        logits_to_keep=1,  # only the K/V are wanted
    )
    fresh = from_dynamic_cache(cache, begin=n_tokens)  # the appended entries: (L, H, S, D)
    sel_rows = sel.to(keys.device)
    keys[:, :, sel_rows] = fresh.keys.to(device=keys.device, dtype=keys.dtype)
    values[:, :, sel_rows] = fresh.values.to(device=values.device, dtype=values.dtype)
    return KVChunk(keys, values, chunk.start)


class _StopForward(Exception):
    """Raised inside a forward pass once the wanted layer's K/V are known."""


class _LayerCapturingCache(DynamicCache):
    """A ``DynamicCache`` that keeps the new K/V of one layer and then aborts the forward pass."""

    def __init__(self, config, layer: int):
        super().__init__()  # full layers for every layer type (see to_dynamic_cache)
        self._layer = layer
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == self._layer:
            self.captured = (key_states, value_states)
            raise _StopForward
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def layer_kv(model, input_ids: torch.Tensor, layer: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one layer as a single-pass prefill of ``input_ids`` at ``start..`` computes them, cheaply.

    Runs layers ``0 .. layer - 1`` in full and ``layer`` up to its K/V projection, then stops: the rest of that
    layer, the layers above and the LM head are skipped, so it costs about ``(layer + 1) / layers`` of a
    prefill's transformer blocks.

    Args:
        model: A Hugging Face causal LM.
        input_ids: ``[seq]`` or ``[1, seq]`` token ids.
        layer: Decoder layer index, ``0 <= layer < layers``.
        start: Global position of ``input_ids[0]``.

    Returns:
        ``(keys, values)``, each ``[kv_heads, seq, head_dim]`` (RoPE keys rotated at ``start..``).
    """
    n_layers = model.config.num_hidden_layers
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} does not exist: this model has layers 0..{n_layers - 1}.")
    ids = input_ids.view(1, -1).to(model.device)
    cache = _LayerCapturingCache(model.config, layer)
    mask = torch.ones(1, ids.shape[1], dtype=torch.long, device=ids.device)
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=_position_ids(start, ids.shape[1], ids.device),
              cache=cache, use_cache=True)
    except _StopForward:
        pass
    if cache.captured is None:
        raise MotCagError(f"The model never wrote layer {layer}'s K/V to its cache; it cannot be probed this way.")
    keys, values = cache.captured
    return keys[0], values[0]  # (1, H, T, D) -> (H, T, D)
