"""Per-family KV-cache layout: how many layers, KV heads, head size, and how positions are encoded.

A :class:`KVLayout` is everything the rest of mot-cag needs to know about a model's cache without touching the
model: the store records it beside every chunk, the translators size their inputs and outputs from it, and
assembly decides from ``positions`` whether a chunk can be moved to another position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

#: model_type values whose caches we know how to handle, mapped to our family names.
SUPPORTED_FAMILIES: dict[str, str] = {
    "gpt2": "gpt2",
    "opt": "opt",
    "qwen2": "qwen2",
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen2",
    "gemma3_text": "gemma3",
}

ROPE_FAMILIES = {"qwen2", "llama", "gemma3"}


@dataclass(frozen=True)
class KVLayout:
    """Shape and position convention of one model's KV cache.

    Every cache tensor of a layer is ``[batch, kv_heads, seq, head_dim]``; a chunk stacks layers into
    ``[layers, kv_heads, seq, head_dim]``.

    Attributes:
        family: Our family name (``gpt2``, ``opt``, ``qwen2``, ``llama``).
        model_type: The Hugging Face ``model_type``.
        layers: Number of decoder layers (each holds one K and one V tensor).
        kv_heads: Key/value heads per layer (fewer than query heads under GQA).
        query_heads: Attention (query) heads per layer.
        head_dim: Size of one head.
        hidden_size: Residual width.
        positions: ``rope`` (keys rotated by position, can be re-rotated) or ``absolute`` (positions are
            added to the embeddings and live in every layer's K/V).
        position_offset: Added to position ids inside the model (OPT: 2).
        max_positions: Longest sequence the model accepts.
        rope_theta: RoPE base, ``None`` for absolute positions.
        rope_type: RoPE variant (``default``, ``linear``, ``yarn``...), ``None`` for absolute positions.
        layer_types: Per-layer attention type (``full_attention`` / ``sliding_attention``) when the model
            mixes them (Gemma3), else ``None``.
        layer_rope_theta: Per-layer RoPE base when it differs by layer type (Gemma3: 1e4 sliding, 1e6 full),
            else ``None`` (every layer uses ``rope_theta``).
        sliding_window: Window of the sliding-attention layers, ``None`` without them. Chunks still hold
            every position in every layer (a chunk may later sit anywhere in a longer context); the model's
            mask limits what sliding layers attend to.
    """

    family: str
    model_type: str
    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    hidden_size: int
    positions: Literal["rope", "absolute"]
    position_offset: int
    max_positions: int
    rope_theta: float | None = None
    rope_type: str | None = None
    layer_types: tuple[str, ...] | None = None
    layer_rope_theta: tuple[float, ...] | None = None
    sliding_window: int | None = None

    @property
    def kv_width(self) -> int:
        """Flattened width of one layer's keys (or values) per token: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, stored in chunk metadata and translator configs."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`; unknown keys from newer files are ignored."""
        names = set(cls.__dataclass_fields__)
        kept = {k: v for k, v in data.items() if k in names}
        for key in ("layer_types", "layer_rope_theta"):  # JSON gives lists; the dataclass is frozen/hashable
            if kept.get(key) is not None:
                kept[key] = tuple(kept[key])
        return cls(**kept)

    @classmethod
    def from_config(cls, config: Any) -> KVLayout:
        """Read the layout from a Hugging Face model config.

        Raises:
            ValueError: If the model family is not supported.
        """
        model_type = getattr(config, "model_type", "?")
        family = SUPPORTED_FAMILIES.get(model_type)
        if family is None:
            supported = ", ".join(sorted(SUPPORTED_FAMILIES))
            raise ValueError(
                f"Model type '{model_type}' is not supported; mot-cag handles these families: {supported}."
            )
        if family == "gpt2":
            heads = config.n_head
            return cls(
                family=family,
                model_type=model_type,
                layers=config.n_layer,
                kv_heads=heads,
                query_heads=heads,
                head_dim=config.n_embd // heads,
                hidden_size=config.n_embd,
                positions="absolute",
                position_offset=0,
                max_positions=config.n_positions,
            )
        if family == "opt":
            heads = config.num_attention_heads
            return cls(
                family=family,
                model_type=model_type,
                layers=config.num_hidden_layers,
                kv_heads=heads,
                query_heads=heads,
                head_dim=config.hidden_size // heads,
                hidden_size=config.hidden_size,
                positions="absolute",
                position_offset=2,  # OPTLearnedPositionalEmbedding adds 2 to every position id
                max_positions=config.max_position_embeddings,
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer_types = getattr(config, "layer_types", None)
        per_type = _per_layer_type_rope(config)
        layer_theta = None
        if per_type is not None:
            layer_types = list(layer_types)
            layer_theta = tuple(float(per_type[t].get("rope_theta", 10000.0)) for t in layer_types)
            rope = per_type.get("full_attention") or next(iter(per_type.values()))
        else:
            rope = _rope_parameters(config)
        has_sliding = bool(layer_types) and "sliding_attention" in layer_types
        return cls(
            family=family,
            model_type=model_type,
            layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            query_heads=heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            positions="rope",
            position_offset=0,
            max_positions=config.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=str(rope.get("rope_type", "default")),
            layer_types=tuple(layer_types) if has_sliding else None,
            layer_rope_theta=layer_theta,
            sliding_window=(int(config.sliding_window) if has_sliding and getattr(config, "sliding_window", None)
                            else None),
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if not params and getattr(config, "rope_theta", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_theta}
    return dict(params)


def _per_layer_type_rope(config: Any) -> dict[str, dict[str, Any]] | None:
    """RoPE parameters keyed by layer type (Gemma3's ``{"full_attention": {...}, "sliding_attention": {...}}``),
    or ``None`` when one set applies to every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types and all(isinstance(params.get(t), dict) for t in set(layer_types)):
        return {t: dict(params[t]) for t in set(layer_types)}
    return None


def rope_inv_freq(config: Any, layer_type: str | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies of a config, ``[rotary_dim // 2]`` (float32).

    Uses transformers' own initialisers for non-default RoPE variants so scaled RoPE matches the model.

    Args:
        config: Hugging Face config.
        layer_type: For models with RoPE parameters per layer type (Gemma3), which type; defaults to
            ``full_attention`` there, ignored elsewhere.
    """
    per_type = _per_layer_type_rope(config)
    if per_type is not None:
        layer_type = layer_type or ("full_attention" if "full_attention" in per_type else next(iter(per_type)))
        rope = per_type[layer_type]
    else:
        layer_type = None
        rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
        return inv_freq.float()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = float(rope.get("rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
