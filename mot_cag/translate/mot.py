"""The Mixture-of-Translators module and its configuration.

Shapes used throughout (``n`` translated layers, ``T`` target tokens, widths are ``kv_heads * head_dim``)::

    source window  (n, T, W_src)   source K (or V) of the mapped source layers, averaged onto target tokens,
                                   RoPE keys un-rotated (position-free)
    side features  (1, T, P)       target-position features (absolute targets), target token embeddings
    expert output  (n, T, W_tgt)   target K (or V) of the translated layers, RoPE keys un-rotated
    router weights (T, K)          per-token mixture over the K experts (top-k, softmax)

Keys and values have separate mixtures. A mixture is ``base(x, p) + sum_k w_k f_k(x, p)`` in a per-layer
normalised space (calibrated means and scales are buffers saved with the weights): ``base`` is one shared
linear map (the identity at first, then the closed-form ridge fit), and each expert ``f_k`` is a non-linear
correction ending in a zero-initialised projection, so an untrained translator between two copies of one
model reproduces the source cache exactly. ``p`` holds per-token side features: target positions
(absolute-position targets) and optionally the target's own token embeddings. Expert kinds:

* ``attn`` (the paper's): ``f`` attends across the window's layers (per token) and causally across tokens
  (per layer), then an MLP;
* ``mlp``: ``f`` is a per-layer two-layer MLP (cheap, no token mixing);
* ``linear``: no experts, the shared map alone (the closed-form ridge baseline).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mot_cag.models.layout import KVLayout
from mot_cag.translate.layers import LayerMap
from mot_cag.translate.spec import EXPERT_KINDS, ExpertKind, TranslatorConfig, TranslatorSpec

__all__ = ["EXPERT_KINDS", "ExpertKind", "Translator", "TranslatorConfig", "TranslatorSpec", "build_translator"]


def position_features(positions: torch.Tensor, dims: int, max_positions: int) -> torch.Tensor:
    """Sinusoidal features ``[T, dims]`` of integer positions (periods from 2 to ~2 * max_positions)."""
    half = dims // 2
    freqs = torch.exp(-math.log(2.0 * max_positions) * torch.arange(half, dtype=torch.float32) / max(half, 1))
    angles = positions.float()[:, None] * freqs[None, :] * math.pi  # (T, dims/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# ---------------------------------------------------------------------------------------------- experts


class _PerLayerLinear(nn.Module):
    """``n`` independent linear maps applied to ``(n, T, in)`` -> ``(n, T, out)``."""

    def __init__(self, n: int, d_in: int, d_out: int, init: Literal["eye", "zero", "normal"] = "normal",
                 bias: bool = True):
        super().__init__()
        if init == "eye":
            w = torch.eye(d_in, d_out).expand(n, d_in, d_out).clone()
        elif init == "zero":
            w = torch.zeros(n, d_in, d_out)
        else:
            w = torch.randn(n, d_in, d_out) / math.sqrt(d_in)
        self.weight = nn.Parameter(w)  # (n, in, out)
        self.bias = nn.Parameter(torch.zeros(n, 1, d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("ntw,nwo->nto", x, self.weight)  # (n, T, out)
        return y if self.bias is None else y + self.bias


class _Block(nn.Module):
    """Pre-norm attention + MLP over the second-to-last axis of ``(batch, seq, d)``."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # q, k, v: (B, heads, S, d/heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))  # (B, S, d)
        return x + self.mlp(self.norm2(x))


def shift_tokens(x: torch.Tensor, k: int = 1) -> torch.Tensor:
    """``(n, T, W)`` -> the rows ``k`` tokens back, zeros before the first token."""
    k = min(k, x.shape[1])
    return torch.cat([torch.zeros_like(x[:, :k]), x[:, : x.shape[1] - k]], dim=1)


def previous_tokens(x: torch.Tensor, count: int) -> torch.Tensor:
    """``(n, T, W)`` -> ``(n, T, count * W)``: the rows 1..count tokens back, concatenated."""
    return torch.cat([shift_tokens(x, k) for k in range(1, count + 1)], dim=-1)


class LinearMap(nn.Module):
    """The shared linear part of a mixture: ``x A + prev(x) B + p C + b`` per layer, ``(n, T, W_in)`` ->
    ``(n, T, W_out)``. Starts as the (rectangular) identity; the ridge fit writes it in closed form."""

    def __init__(self, n: int, d_in: int, d_out: int, side: int, prev_token: int = 0):
        super().__init__()
        self.linear = _PerLayerLinear(n, d_in, d_out, init="eye")
        self.prev_count = int(prev_token)
        self.prev = _PerLayerLinear(n, self.prev_count * d_in, d_out, init="zero", bias=False) if prev_token else None
        self.pos = _PerLayerLinear(n, side, d_out, init="zero", bias=False) if side else None

    def forward(self, x: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        y = self.linear(x)  # (n, T, out)
        if self.prev is not None:
            y = y + self.prev(previous_tokens(x, self.prev_count))
        if self.pos is not None and p is not None:
            y = y + self.pos(p.expand(x.shape[0], -1, -1))
        return y


class Expert(nn.Module):
    """One translator's non-linear correction: ``(n, T, W_in)`` (+ side features ``(1, T, P)``) ->
    ``(n, T, W_out)``, added to the shared linear map; its output projection starts at zero."""

    def __init__(self, kind: ExpertKind, n: int, d_in: int, d_out: int, hidden: int, heads: int, side: int):
        super().__init__()
        self.kind = kind
        self.inp = _PerLayerLinear(n, d_in, hidden)
        self.pos_in = nn.Linear(side, hidden) if side else None
        self.out = _PerLayerLinear(n, hidden, d_out, init="zero")
        if kind == "attn":
            self.layer_emb = nn.Parameter(torch.randn(n, 1, hidden) * 0.02)
            self.across_layers = _Block(hidden, heads, causal=False)
            self.across_tokens = _Block(hidden, heads, causal=True)
            self.norm = nn.LayerNorm(hidden)
        else:
            self.mid = nn.Sequential(nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())

    def forward(self, x: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        h = self.inp(x)  # (n, T, hidden)
        if self.pos_in is not None and p is not None:
            h = h + self.pos_in(p)
        if self.kind == "attn":
            h = h + self.layer_emb
            h = self.across_layers(h.transpose(0, 1)).transpose(0, 1)  # attend over layers: (T, n, hidden)
            h = self.across_tokens(h)  # causal over tokens, per layer: (n, T, hidden)
            h = self.norm(h)
        else:
            h = self.mid(h)
        return self.out(h)


class MixtureOfTranslators(nn.Module):
    """K experts and a per-token top-k router for one of keys or values.

    Buffers ``in_mean/in_std`` ``(n, 1, W_in)`` and ``out_mean/out_std`` ``(n, 1, W_out)`` normalise each layer
    (calibrated before training); they start at 0/1 so an untrained mixture is the identity on equal widths.
    """

    def __init__(self, cfg: TranslatorConfig, n: int, d_in: int, d_out: int):
        super().__init__()
        self.top_k = cfg.top_k
        self.base = LinearMap(n, d_in, d_out, cfg.side_features, cfg.prev_token)
        count = 0 if cfg.expert == "linear" else cfg.experts
        self.experts = nn.ModuleList(
            Expert(cfg.expert, n, d_in, d_out, cfg.hidden, cfg.heads, cfg.side_features) for _ in range(count)
        )
        self.router = None
        if count > 1:
            hidden = max(32, min(cfg.hidden, n * d_in))
            self.router = nn.Sequential(nn.LayerNorm(n * d_in), nn.Linear(n * d_in, hidden), nn.GELU(),
                                        nn.Linear(hidden, cfg.experts))
        for name, width in (("in_mean", d_in), ("out_mean", d_out)):
            self.register_buffer(name, torch.zeros(n, 1, width))
        for name, width in (("in_std", d_in), ("out_std", d_out)):
            self.register_buffer(name, torch.ones(n, 1, width))
        self.last_weights: torch.Tensor | None = None

    def route(self, xn: torch.Tensor) -> torch.Tensor:
        """Mixture weights ``(T, K)``: softmax over the top-k router logits of each token."""
        n, t, w = xn.shape
        logits = self.router(xn.transpose(0, 1).reshape(t, n * w))  # (T, K)
        if self.top_k < logits.shape[-1]:
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(self.top_k, -1).indices, True)
            logits = logits.masked_fill(~keep, float("-inf"))
        return logits.softmax(-1)

    def forward(self, x: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        """Translate ``(n, T, W_in)`` to ``(n, T, W_out)``."""
        xn = (x - self.in_mean) / self.in_std
        y = self.base(xn, p)  # (n, T, out)
        outs = [e(xn, p) for e in self.experts]
        self.last_weights = None
        if len(outs) == 1:
            y = y + outs[0]
        elif outs:
            weights = self.route(xn)  # (T, K)
            self.last_weights = weights
            y = y + torch.einsum("knto,tk->nto", torch.stack(outs), weights)  # (n, T, out)
        return y * self.out_std + self.out_mean

    def balance(self) -> dict[str, float]:
        """Load-balance statistics of the last forward: squared CV of importance and load, normalised entropy."""
        if self.last_weights is None:
            return {}
        w = self.last_weights.detach()
        importance, load = w.sum(0), (w > 0).float().sum(0)  # (K,)

        def cv2(v: torch.Tensor) -> float:
            return float(v.var(unbiased=False) / (v.mean() ** 2 + 1e-9))

        share = importance / importance.sum().clamp_min(1e-9)
        entropy = float(-(share * share.clamp_min(1e-9).log()).sum() / math.log(len(share)))
        return {"importance_cv2": cv2(importance), "load_cv2": cv2(load), "entropy": entropy}

    def balance_loss(self) -> torch.Tensor:
        """Differentiable importance CV² of the last forward (0 for a single expert)."""
        if self.last_weights is None:
            return torch.zeros(())
        imp = self.last_weights.sum(0)
        return imp.var(unbiased=False) / (imp.mean() ** 2 + 1e-9)


def _default_inv_freq(layout: KVLayout) -> torch.Tensor:
    """RoPE inverse frequencies from a layout (default RoPE); empty for absolute positions."""
    if layout.positions != "rope":
        return torch.zeros(0)
    from mot_cag.models.positions import Positioner

    return Positioner(layout).inv_freq.float().clone()


class Translator(nn.Module):
    """A (source, target) cache translator: one mixture for keys and one for values.

    Use :func:`mot_cag.translate.inject.translate` to translate a :class:`~mot_cag.models.cache.KVChunk`;
    :meth:`forward` works on already-aligned, flattened, position-free windows.
    """

    def __init__(self, config: TranslatorConfig):
        super().__init__()
        self.config = config
        src, tgt, lm = config.src, config.tgt, config.layers
        self.keys = MixtureOfTranslators(config, lm.size, src.kv_width, tgt.kv_width)
        self.values = MixtureOfTranslators(config, lm.size, src.kv_width, tgt.kv_width)
        # RoPE frequencies travel with the weights: at translation time the source model is not loaded.
        self.register_buffer("src_inv_freq", _default_inv_freq(src))
        self.register_buffer("tgt_inv_freq", _default_inv_freq(tgt))
        # Target-embedding normalisation (calibrated with the rest); (1, E).
        self.register_buffer("emb_mean", torch.zeros(1, config.token_features))
        self.register_buffer("emb_std", torch.ones(1, config.token_features))
        # Principal directions of the normalised embeddings (E, r), fitted at calibration (token_rank > 0).
        if config.token_rank:
            self.register_buffer("emb_proj", torch.eye(config.token_features, config.token_rank))
        else:
            self.emb_proj = None

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return next(self.parameters()).dtype

    def side(self, positions: torch.Tensor | None, embeddings: torch.Tensor | None,
             device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """Per-token side features ``(1, T, P)``: position features, normalised target embeddings (and the
        previous token's), or ``None`` when the config uses neither."""
        cfg = self.config
        parts = []
        if cfg.pos_features:
            if positions is None:
                raise ValueError("this translator needs the target positions")
            parts.append(position_features(positions.cpu(), cfg.pos_features, cfg.tgt.max_positions).to(device))
        if cfg.token_features:
            if embeddings is None:
                raise ValueError("this translator needs the target's token embeddings (pass the target model)")
            e = (embeddings.to(device=device, dtype=dtype) - self.emb_mean) / self.emb_std  # (T, E)
            if self.emb_proj is not None:
                e = e @ self.emb_proj.to(dtype)  # (T, r)
            parts.append(e)
            if cfg.prev_token:
                parts.append(previous_tokens(e.unsqueeze(0), int(cfg.prev_token))[0])
        if not parts:
            return None
        return torch.cat(parts, dim=-1).to(dtype).unsqueeze(0)  # (1, T, P)

    def forward(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate aligned source windows.

        Args:
            keys: ``(n, T, W_src)`` un-rotated source keys on the target token grid.
            values: ``(n, T, W_src)``.
            positions: ``[T]`` target positions (used when the target has absolute positions).
            embeddings: ``(T, E)`` target input embeddings of the target tokens (when ``token_features``).

        Returns:
            ``(keys, values)``, each ``(n, T, W_tgt)``; keys un-rotated for RoPE targets.
        """
        p = self.side(positions, embeddings, keys.device, keys.dtype)
        return self.keys(keys, p), self.values(values, p)

    def balance(self) -> dict[str, float]:
        """Router statistics of the last forward, keys and values averaged."""
        k, v = self.keys.balance(), self.values.balance()
        return {name: (k[name] + v[name]) / 2 for name in k}

    def balance_loss(self) -> torch.Tensor:
        """Auxiliary load-balance loss of the last forward."""
        return self.keys.balance_loss().to(self.device) + self.values.balance_loss().to(self.device)

    def parameter_count(self) -> int:
        """Trainable parameters."""
        return sum(p.numel() for p in self.parameters())


def build_translator(source, target, spec: TranslatorSpec | None = None, **fields) -> Translator:
    """A fresh (identity-initialised) translator for two loaded models.

    Args:
        source: Source :class:`~mot_cag.models.registry.LoadedModel`.
        target: Target :class:`~mot_cag.models.registry.LoadedModel`.
        spec: What to build (:class:`~mot_cag.translate.spec.TranslatorSpec`).
        **fields: Instead of ``spec``, its fields (``expert="mlp", experts=2, ...``); the rest default.
    """
    if spec is None:
        spec = TranslatorSpec(**fields)
    elif fields:
        spec = replace(spec, **fields)
    from mot_cag.translate.alignment import tokenizer_fingerprint

    lm = LayerMap.build(source.layout.layers, target.layout.layers, spec.coverage, spec.window_start,
                        spec.window_width)
    pos_features = spec.pos_features
    if pos_features is None:
        pos_features = 32 if target.layout.positions == "absolute" else 0
    cfg = TranslatorConfig(
        source=source.name, target=target.name,
        source_layout=source.layout.to_dict(), target_layout=target.layout.to_dict(),
        layer_map=lm.to_dict(), coverage=spec.coverage, expert=spec.expert, experts=spec.experts,
        top_k=min(spec.top_k, spec.experts), hidden=spec.hidden, heads=spec.heads, pos_features=pos_features,
        prev_token=int(spec.prev_token),
        token_features=target.model.get_input_embeddings().weight.shape[1] if spec.token_features else 0,
        token_rank=int(spec.token_rank) if spec.token_features else 0,
        source_fingerprint=source.fingerprint, target_fingerprint=target.fingerprint,
        source_tokenizer=tokenizer_fingerprint(source.tokenizer),
        target_tokenizer=tokenizer_fingerprint(target.tokenizer),
        kind=spec.label,
    )
    translator = Translator(cfg)
    # Exact frequencies from the model configs (scaled RoPE variants differ from the default formula).
    from mot_cag.models.layout import rope_inv_freq

    if source.layout.positions == "rope":
        translator.src_inv_freq = rope_inv_freq(source.model.config)
    if target.layout.positions == "rope":
        translator.tgt_inv_freq = rope_inv_freq(target.model.config)
    return translator.to(target.device)
