"""Moving cached K/V to other positions: RoPE keys are rotated by the position delta (rotations compose, so
the move is exact); per-layer bases (Gemma3) are honoured; absolute-position families are refused.

Plain tensor math on :class:`~mot_cag.models.cache.KVChunk`; the transformers cache API stays in
:mod:`mot_cag.models.cache`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mot_cag.errors import MotCagError
from mot_cag.models.cache import KVChunk, join
from mot_cag.models.layout import KVLayout, rope_inv_freq


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE keys by ``delta`` positions (HF ``rotate_half`` convention).

    Args:
        keys: ``[..., seq, head_dim]``.
        delta: Scalar shift, or ``[seq]`` per-token shifts.
        inv_freq: ``[rotary_dim // 2]``; dims past ``rotary_dim`` are left alone (partial rotary).
    """
    rot = inv_freq.shape[0] * 2
    delta_t = torch.as_tensor(delta, dtype=torch.float64, device=keys.device)
    if delta_t.dim() == 0:
        delta_t = delta_t.expand(keys.shape[-2])
    # Angles in float64 so large shifts stay exact to fp32 precision.
    freqs = delta_t[:, None] * inv_freq.to(device=keys.device, dtype=torch.float64)[None, :]  # (T, rot/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, rot)
    cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    k_rot, k_pass = keys[..., :rot], keys[..., rot:]
    half = rot // 2
    rotated_half = torch.cat((-k_rot[..., half:], k_rot[..., :half]), dim=-1)
    return torch.cat((k_rot * cos + rotated_half * sin, k_pass), dim=-1)


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (D/2,)


class Positioner:
    """Moves chunks of one model to new global positions.

    Attributes:
        inv_freq: ``[rotary_dim // 2]`` frequencies of the model's (full-attention) layers.
        layer_groups: For models whose RoPE base differs by layer (Gemma3), ``[(layer indices, inv_freq)]``,
            one entry per distinct base; ``None`` when every layer uses :attr:`inv_freq`.
    """

    def __init__(self, layout: KVLayout, config=None):
        self.layout = layout
        self.inv_freq = None
        self.layer_groups: list[tuple[list[int], torch.Tensor]] | None = None
        if layout.positions != "rope":
            return
        if config is not None:
            self.inv_freq = rope_inv_freq(config)
        else:
            self.inv_freq = _default_inv_freq(layout.rope_theta or 10000.0, layout.head_dim)
        if layout.layer_rope_theta is not None and len(set(layout.layer_rope_theta)) > 1:
            groups: dict[str, list[int]] = {}
            for i, t in enumerate(layout.layer_types or ()):
                groups.setdefault(t, []).append(i)
            self.layer_groups = []
            for layer_type, idx in groups.items():
                if config is not None:
                    inv = rope_inv_freq(config, layer_type)
                else:
                    inv = _default_inv_freq(layout.layer_rope_theta[idx[0]], layout.head_dim)
                self.layer_groups.append((idx, inv))

    def reposition(self, chunk: KVChunk, new_start: int) -> KVChunk:
        """The same chunk as if it had been prefilled at ``new_start``.

        Raises:
            MotCagError: For absolute-position families, whose K/V cannot be moved after prefill.
        """
        delta = new_start - chunk.start
        if delta == 0:
            return chunk
        if self.layout.positions != "rope":
            raise MotCagError(
                f"Cannot move a {self.layout.family} cache from position {chunk.start} to {new_start}: "
                "absolute positions are baked into every layer's K/V; prefill (or translate) the chunk at its "
                "target position instead."
            )
        if self.layer_groups is None:
            keys = rotate_keys(chunk.keys, delta, self.inv_freq)
        else:
            keys = torch.empty_like(chunk.keys)
            for idx, inv in self.layer_groups:
                rows = torch.tensor(idx, device=chunk.keys.device)
                keys[rows] = rotate_keys(chunk.keys[rows], delta, inv)  # (n, H, T, D)
        return KVChunk(keys, chunk.values, new_start)

    def concat(self, chunks: Sequence[KVChunk], start: int = 0) -> KVChunk:
        """Place chunks one after another from ``start`` and join them into one context."""
        if not chunks:
            raise ValueError("concat needs at least one chunk")
        placed = []
        pos = start
        for chunk in chunks:
            placed.append(self.reposition(chunk, pos))
            pos += chunk.length
        return join(placed)
