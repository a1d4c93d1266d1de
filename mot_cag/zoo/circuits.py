"""Construct previous-token heads at initialisation, so that induction (copying) can be learned quickly.

Why: an induction head needs a previous-token head below it, and neither gets a gradient signal without
the other, which is why copying emerges late and abruptly from scratch (measured in issue 4: thousands of
steps on this CPU). Giving layer 0 exact previous-token heads by construction removes that chicken-and-egg
problem; everything else (induction, entity tracking, the answer format) is still learned by gradient
descent and every weight stays trainable. The architecture is unchanged: only initial values are set.

Residual layout at initialisation (dims of the hidden state)::

    [0, E)             token embedding (unit-norm, zero-mean rows)
    [E, E+S)           sinusoidal positions (absolute-position models only; +/- pairs keep LayerNorm's
                       mean at zero)
    next E per offset  P_k: the embedding of the token k positions back, written by layer-0 heads
    rest               free for learning

Attention score of a constructed head between query position m and key position n is
``sum_i c_i cos(w_i (m - n - k))`` (RoPE: from constant q/k biases; absolute: from the sinusoid dims), whose
maximum is at ``m - n = k``. The amplitudes ``c_i`` come from a small linear program that maximises the
worst-case margin over all other offsets up to the context length, then are scaled to ``MARGIN_NATS``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linprog

from mot_cag.zoo.models import MAX_POSITIONS, ZooSpec

MARGIN_NATS = 12.0  # score gap between the target offset and any other: ~e^-12 attention leak per position


def offset_amplitudes(freqs: np.ndarray, max_offset: int, length: int = MAX_POSITIONS) -> tuple[np.ndarray, float]:
    """Weights ``w_i >= 0`` (sum 1) maximising ``min_x sum_i w_i (1 - cos(freqs_i x))`` over ``x != 0``.

    Args:
        freqs: Angular frequencies (radians per position).
        max_offset: Largest offset a head is built for (x ranges over ``[-max_offset, length)``).
        length: Context length to be robust over.

    Returns:
        ``(w, margin)``: the weights and the achieved worst-case margin.
    """
    xs = np.array([x for x in range(-max_offset, length) if x != 0], dtype=np.float64)
    gaps = 1.0 - np.cos(np.outer(xs, freqs))  # (X, F)
    n = len(freqs)
    # Variables [w_1..w_F, t]; maximise t s.t. gaps @ w >= t, sum w = 1, w >= 0.
    c = np.zeros(n + 1)
    c[-1] = -1.0
    a_ub = np.hstack([-gaps, np.ones((len(xs), 1))])
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=np.zeros(len(xs)),
        A_eq=np.hstack([np.ones((1, n)), [[0.0]]]),
        b_eq=[1.0],
        bounds=[(0, None)] * n + [(None, None)],
        method="highs",
    )
    if not res.success:
        raise RuntimeError(f"offset LP failed: {res.message}")
    return res.x[:n], float(res.x[-1])


def _unit_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=gen)
    x = x - x.mean(dim=1, keepdim=True)  # zero mean: LayerNorm then only rescales
    return x / x.norm(dim=1, keepdim=True)


class _Layer0:
    """Layer-0 attention weights in (out, in) layout, read from and written back to a model."""

    def __init__(self, model, spec: ZooSpec) -> None:
        self.model, self.spec = model, spec
        h, hd = spec.width, spec.head_dim
        fam = spec.family
        with torch.no_grad():
            if fam == "gpt2":
                attn = model.transformer.h[0].attn
                w, b = attn.c_attn.weight.T.clone(), attn.c_attn.bias.clone()  # Conv1D stores (in, out)
                self.wq, self.wk, self.wv = w[:h].clone(), w[h : 2 * h].clone(), w[2 * h :].clone()
                self.bq, self.bk, self.bv = b[:h].clone(), b[h : 2 * h].clone(), b[2 * h :].clone()
                self.wo = attn.c_proj.weight.T.clone()
            else:
                attn = model.model.decoder.layers[0].self_attn if fam == "opt" else model.model.layers[0].self_attn
                self.wq, self.bq = attn.q_proj.weight.clone(), attn.q_proj.bias.clone()
                self.wk, self.bk = attn.k_proj.weight.clone(), attn.k_proj.bias.clone()
                self.wv, self.bv = attn.v_proj.weight.clone(), attn.v_proj.bias.clone()
                self.wo = (attn.out_proj if fam == "opt" else attn.o_proj).weight.clone()
        self.attn, self.hd = attn, hd

    def write(self) -> None:
        with torch.no_grad():
            if self.spec.family == "gpt2":
                self.attn.c_attn.weight.copy_(torch.cat([self.wq, self.wk, self.wv], 0).T)
                self.attn.c_attn.bias.copy_(torch.cat([self.bq, self.bk, self.bv], 0))
                self.attn.c_proj.weight.copy_(self.wo.T)
            else:
                a = self.attn
                for lin, w, b in (
                    (a.q_proj, self.wq, self.bq),
                    (a.k_proj, self.wk, self.bk),
                    (a.v_proj, self.wv, self.bv),
                ):
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
                (a.out_proj if self.spec.family == "opt" else a.o_proj).weight.copy_(self.wo)


def layout(spec: ZooSpec) -> dict[str, tuple[int, int]]:
    """Residual-dimension blocks used by the construction: ``{"E": (start, end), "S": ..., "P1": ...}``."""
    blocks, at = {}, 0
    for name, size in [("E", spec.embed_dims), ("S", spec.pos_dims)] + [
        (f"P{k}", spec.embed_dims) for k in spec.prev_offsets
    ]:
        if size:
            blocks[name] = (at, at + size)
            at += size
    if at > spec.width:
        raise ValueError(f"{spec.name}: circuit layout needs {at} dims but width is {spec.width}.")
    return blocks


def init_copy_circuit(model, spec: ZooSpec, seed: int = 0) -> dict:
    """Set token/position embeddings and layer-0 heads of a freshly initialised model (in place).

    Args:
        model: A freshly built ``GPT2LMHeadModel``, ``OPTForCausalLM`` or ``Qwen2ForCausalLM``.
        spec: Its zoo spec (layout sizes, offsets).
        seed: Seed of the random token embeddings.

    Returns:
        A JSON-serialisable summary (layout, offsets, LP margin) for the model card.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = layout(spec)
    e0, e1 = blocks["E"]
    de, hd, h = e1 - e0, spec.head_dim, spec.width
    if de % hd:
        raise ValueError(f"{spec.name}: embed_dims {de} must be a multiple of head_dim {hd}.")
    n_slices = de // hd  # heads needed per offset: each head carries hd dims of the embedding
    fam = spec.family
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb.zero_()
        emb[:, e0:e1] = _unit_rows(emb.shape[0], de, gen)
    l0 = _Layer0(model, spec)
    # How much LayerNorm/RMSNorm scales a residual made of unit-norm blocks (E and, if any, S).
    n_blocks = 1 + (1 if spec.pos_dims else 0)
    norm_gain = math.sqrt(h / n_blocks)
    max_off = max(spec.prev_offsets)

    if fam == "qwen2":
        theta = spec.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
        w, margin = offset_amplitudes(theta.numpy(), max_off)
        amp = torch.from_numpy(np.sqrt(w * MARGIN_NATS / margin * math.sqrt(hd)))  # c_i
        group = spec.heads // spec.kv_heads
        if spec.kv_heads < n_slices or group < len(spec.prev_offsets):
            raise ValueError(f"{spec.name}: not enough heads for the constructed previous-token heads.")
        for g in range(n_slices):  # kv group g carries embedding slice g; W=0 so q/k are position-only
            ks = slice(g * hd, (g + 1) * hd)
            l0.wk[ks] = 0.0
            l0.bk[ks] = torch.cat([amp, torch.zeros_like(amp)]).float()  # pair i = (c_i, 0)
            l0.wv[ks] = 0.0
            l0.wv[ks, e0 + g * hd : e0 + (g + 1) * hd] = torch.eye(hd) / norm_gain
            l0.bv[ks] = 0.0
            for j, k in enumerate(spec.prev_offsets):
                head = g * group + j
                qs = slice(head * hd, (head + 1) * hd)
                l0.wq[qs] = 0.0
                # q pair i = c_i e^{-i k theta_i}: score = sum c_i^2 cos((m - n - k) theta_i).
                l0.bq[qs] = torch.cat([amp * torch.cos(k * theta), -amp * torch.sin(k * theta)]).float()
                p0 = blocks[f"P{k}"][0] + g * hd
                l0.wo[:, qs] = 0.0
                l0.wo[p0 : p0 + hd, qs] = torch.eye(hd)
    else:
        s0, s1 = blocks["S"]
        n_freq = (s1 - s0) // 4  # each frequency uses 4 dims: cos, sin, -cos, -sin
        freqs = np.geomspace(1.0, 2 * math.pi / (2 * MAX_POSITIONS), n_freq)
        w, margin = offset_amplitudes(freqs, max_off)
        pos_weight = model.transformer.wpe.weight if fam == "gpt2" else model.model.decoder.embed_positions.weight
        offset = 2 if fam == "opt" else 0  # OPT looks positions up at index position + 2
        pos = torch.arange(pos_weight.shape[0] - offset, dtype=torch.float64)
        ang = torch.outer(pos, torch.from_numpy(freqs))  # (P, F)
        a = 1.0 / math.sqrt(2 * n_freq)  # unit norm for the whole S block
        feats = torch.cat([torch.cos(ang), torch.sin(ang), -torch.cos(ang), -torch.sin(ang)], 1) * a
        with torch.no_grad():
            pos_weight.zero_()
            pos_weight[offset:, s0:s1] = feats.float()
        # After the norm, each (cos, sin) pair has radius a * norm_gain; scale to amplitude c_i.
        amp = np.sqrt(w * MARGIN_NATS / margin * math.sqrt(hd)) / (a * norm_gain)
        if spec.heads < n_slices * len(spec.prev_offsets) or 2 * n_freq > hd:
            raise ValueError(f"{spec.name}: not enough heads or head dims for the constructed heads.")
        for j, k in enumerate(spec.prev_offsets):
            for g in range(n_slices):
                head = j * n_slices + g
                hs = slice(head * hd, (head + 1) * hd)
                for m in (l0.wq, l0.wk, l0.wv):
                    m[hs] = 0.0
                for b in (l0.bq, l0.bk, l0.bv):
                    b[hs] = 0.0
                for i in range(n_freq):
                    cos_d, sin_d = s0 + i, s0 + n_freq + i
                    qi, qj = head * hd + 2 * i, head * hd + 2 * i + 1
                    # k = c (cos wn, sin wn); q = c (cos w(m-k), sin w(m-k)) = c R(-wk) (cos wm, sin wm).
                    l0.wk[qi, cos_d], l0.wk[qj, sin_d] = amp[i], amp[i]
                    ck, sk = math.cos(freqs[i] * k), math.sin(freqs[i] * k)
                    l0.wq[qi, cos_d], l0.wq[qi, sin_d] = amp[i] * ck, amp[i] * sk
                    l0.wq[qj, cos_d], l0.wq[qj, sin_d] = -amp[i] * sk, amp[i] * ck
                l0.wv[hs, e0 + g * hd : e0 + (g + 1) * hd] = torch.eye(hd) / norm_gain
                p0 = blocks[f"P{k}"][0] + g * hd
                l0.wo[:, hs] = 0.0
                l0.wo[p0 : p0 + hd, hs] = torch.eye(hd)
    l0.write()
    return {
        "layout": {k: list(v) for k, v in blocks.items()},
        "prev_offsets": list(spec.prev_offsets),
        "lp_margin": margin,
        "margin_nats": MARGIN_NATS,
        "seed": seed,
    }
