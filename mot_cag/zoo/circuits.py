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
MATCH_NATS = 10.0  # induction score per matched token (a bigram match beats a unigram match by this)
RESIDUAL_INIT_SCALE = 0.1  # random residual writes (MLP out, attention out) start this much smaller
COPY_LOGIT = 12.0  # logit given to the copied token's code (others get ~0 +/- COPY_LOGIT / sqrt(E))


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


class _Attn:
    """One layer's attention weights in (out, in) layout, read from and written back to a model."""

    def __init__(self, model, spec: ZooSpec, layer: int) -> None:
        self.spec = spec
        h = spec.width
        fam = spec.family
        with torch.no_grad():
            if fam == "gpt2":
                attn = model.transformer.h[layer].attn
                w, b = attn.c_attn.weight.T.clone(), attn.c_attn.bias.clone()  # Conv1D stores (in, out)
                self.wq, self.wk, self.wv = w[:h].clone(), w[h : 2 * h].clone(), w[2 * h :].clone()
                self.bq, self.bk, self.bv = b[:h].clone(), b[h : 2 * h].clone(), b[2 * h :].clone()
                self.wo = attn.c_proj.weight.T.clone()
            else:
                layers = model.model.decoder.layers if fam == "opt" else model.model.layers
                attn = layers[layer].self_attn
                self.wq, self.bq = attn.q_proj.weight.clone(), attn.q_proj.bias.clone()
                self.wk, self.bk = attn.k_proj.weight.clone(), attn.k_proj.bias.clone()
                self.wv, self.bv = attn.v_proj.weight.clone(), attn.v_proj.bias.clone()
                self.wo = (attn.out_proj if fam == "opt" else attn.o_proj).weight.clone()
        self.attn = attn

    def clear_head(self, q_head: int, kv_head: int) -> None:
        """Zero the q rows of a query head, the k/v rows of its kv head, and its output columns."""
        hd = self.spec.head_dim
        qs, ks = slice(q_head * hd, (q_head + 1) * hd), slice(kv_head * hd, (kv_head + 1) * hd)
        for m, sl in ((self.wq, qs), (self.bq, qs), (self.wk, ks), (self.bk, ks), (self.wv, ks), (self.bv, ks)):
            m[sl] = 0.0
        self.wo[:, qs] = 0.0

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
    """Residual-dimension blocks of the construction: ``{"E": (start, end), "S": ..., "P1": ..., "C": ...}``."""
    sizes = [("E", spec.embed_dims), ("S", spec.pos_dims)]
    sizes += [(f"P{k}", spec.embed_dims) for k in spec.prev_offsets]
    sizes += [("C", spec.embed_dims if spec.induction else 0)]
    blocks, at = {}, 0
    for name, size in sizes:
        if size:
            blocks[name] = (at, at + size)
            at += size
    if at > spec.width:
        raise ValueError(f"{spec.name}: circuit layout needs {at} dims but width is {spec.width}.")
    return blocks


def _shrink_residual_writes(model, family: str) -> None:
    """Scale down every random matrix that writes into the residual stream, and zero its bias.

    Why: with default init a random MLP (OPT's in particular) adds more to the residual than the unit-norm
    blocks of the construction, drowning the copy circuit before training has started.
    """
    names = {
        "gpt2": ("attn.c_proj", "mlp.c_proj"),
        "opt": ("self_attn.out_proj", "fc2"),
        "qwen2": ("self_attn.o_proj", "mlp.down_proj"),
    }[family]
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith(names) and hasattr(mod, "weight"):
                mod.weight.mul_(RESIDUAL_INIT_SCALE)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()


def _kv_of(spec: ZooSpec, q_head: int) -> int:
    return q_head // (spec.heads // spec.kv_heads)


def _eye_into(m: torch.Tensor, rows, cols: tuple[int, int], scale: float) -> None:
    """Add ``scale * I`` mapping residual block ``cols`` onto head rows ``rows`` (a list of row indices)."""
    for j, r in enumerate(rows):
        m[r, cols[0] + j] += scale


def init_copy_circuit(model, spec: ZooSpec, seed: int = 0) -> dict:
    """Set embeddings, layer-0 previous-token heads and (optionally) a layer-1 induction head, in place.

    Layer 0: one head per offset ``k`` in ``spec.prev_offsets`` copies the embedding of token ``m - k``
    into block ``P<k>``. Layer 1 (``spec.induction``): one head matches ``(E + P1)`` at the query with
    ``(P1 + P2)`` at the key (the current and previous token against the key's two predecessors), copies the
    key token's embedding into block ``C``, and the LM head reads ``C`` with the embedding codes, so the
    model starts out predicting "what followed the last occurrence of this bigram". For Qwen2 the matching
    uses the slowest ``embed_dims / 2`` RoPE pairs, so it only ignores distance when ``head_dim`` leaves
    that many slow pairs (``head_dim >= 2 * embed_dims`` with a large ``rope_theta``); with the shipped
    ``head_dim == embed_dims`` the fast pairs are used too and add distance-dependent noise.

    Args:
        model: A freshly built ``GPT2LMHeadModel``, ``OPTForCausalLM`` or ``Qwen2ForCausalLM``.
        spec: Its zoo spec (layout sizes, offsets).
        seed: Seed of the random token codes.

    Returns:
        A JSON-serialisable summary (layout, offsets, LP margin) for the model card.
    """
    gen = torch.Generator().manual_seed(seed)
    _shrink_residual_writes(model, spec.family)
    blocks = layout(spec)
    e0, e1 = blocks["E"]
    de, hd, h = e1 - e0, spec.head_dim, spec.width
    if de > hd:
        raise ValueError(f"{spec.name}: embed_dims {de} must not exceed head_dim {hd}.")
    fam = spec.family
    emb = model.get_input_embeddings().weight
    codes = _unit_rows(emb.shape[0], de, gen)
    with torch.no_grad():
        emb.zero_()
        emb[:, e0:e1] = codes
    l0 = _Attn(model, spec, 0)
    # How much LayerNorm/RMSNorm scales a residual made of unit-norm blocks.
    gain0 = math.sqrt(h / (2 if spec.pos_dims else 1))
    max_off = max(spec.prev_offsets)
    if len(spec.prev_offsets) > spec.heads // spec.kv_heads and fam == "qwen2":
        raise ValueError(f"{spec.name}: a kv group needs one query head per previous-token offset.")

    if fam == "qwen2":
        theta = spec.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
        w, margin = offset_amplitudes(theta.numpy(), max_off)
        amp = torch.from_numpy(np.sqrt(w * MARGIN_NATS / margin * math.sqrt(hd)))  # c_i
        for j, k in enumerate(spec.prev_offsets):  # all in kv group 0, whose k/v are position-only / E
            l0.clear_head(j, 0)
            # q pair i = c_i e^{-i k theta_i}, k pair i = c_i: score = sum c_i^2 cos((m - n - k) theta_i).
            l0.bq[j * hd : (j + 1) * hd] = torch.cat([amp * torch.cos(k * theta), -amp * torch.sin(k * theta)]).float()
            _eye_into(l0.wo, range(*blocks[f"P{k}"]), (j * hd, j * hd + de), 1.0)
        l0.bk[:hd] = torch.cat([amp, torch.zeros_like(amp)]).float()
        _eye_into(l0.wv, range(de), blocks["E"], 1.0 / gain0)
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
        # After the norm, each (cos, sin) pair has radius a * gain0; scale to amplitude c_i.
        amp = np.sqrt(w * MARGIN_NATS / margin * math.sqrt(hd)) / (a * gain0)
        if 2 * n_freq > hd:
            raise ValueError(f"{spec.name}: head_dim too small for {n_freq} position frequencies.")
        for j, k in enumerate(spec.prev_offsets):
            l0.clear_head(j, j)
            for i in range(n_freq):
                cos_d, sin_d = s0 + i, s0 + n_freq + i
                qi, qj = j * hd + 2 * i, j * hd + 2 * i + 1
                # k = c (cos wn, sin wn); q = c (cos w(m-k), sin w(m-k)) = c R(-wk) (cos wm, sin wm).
                l0.wk[qi, cos_d], l0.wk[qj, sin_d] = amp[i], amp[i]
                ck, sk = math.cos(freqs[i] * k), math.sin(freqs[i] * k)
                l0.wq[qi, cos_d], l0.wq[qi, sin_d] = amp[i] * ck, amp[i] * sk
                l0.wq[qj, cos_d], l0.wq[qj, sin_d] = -amp[i] * sk, amp[i] * ck
            _eye_into(l0.wv, range(j * hd, j * hd + de), blocks["E"], 1.0 / gain0)
            _eye_into(l0.wo, range(*blocks[f"P{k}"]), (j * hd, j * hd + de), 1.0)
    l0.write()
    info = {
        "layout": {k: list(v) for k, v in blocks.items()},
        "prev_offsets": list(spec.prev_offsets),
        "lp_margin": margin,
        "margin_nats": MARGIN_NATS,
        "seed": seed,
        "induction": spec.induction,
    }
    if spec.induction:
        _init_induction(model, spec, blocks, codes)
        info.update(match_nats=MATCH_NATS, copy_logit=COPY_LOGIT)
    return info


def _init_induction(model, spec: ZooSpec, blocks: dict, codes: torch.Tensor) -> None:
    """Layer-1 head 0: bigram-matching induction head writing the next token's code into block C."""
    de, hd, h = codes.shape[1], spec.head_dim, spec.width
    l1 = _Attn(model, spec, 1)
    n_blocks = 1 + (1 if spec.pos_dims else 0) + len(spec.prev_offsets)
    gain1 = math.sqrt(h / n_blocks)
    if spec.family == "qwen2":
        # The slowest de/2 rotary pairs: pair i occupies dims i and i + hd/2.
        pairs = range(hd // 2 - de // 2, hd // 2)
        match = [i for i in pairs] + [i + hd // 2 for i in pairs]
    else:
        match = list(range(de))
    lam = math.sqrt(MATCH_NATS * math.sqrt(hd)) / gain1
    kv = _kv_of(spec, 0)
    l1.clear_head(0, kv)
    q_rows = [r for r in match]  # head 0 occupies q rows [0, hd)
    k_rows = [kv * hd + r for r in match]
    _eye_into(l1.wq, q_rows, blocks["E"], lam)
    _eye_into(l1.wk, k_rows, blocks["P1"], lam)
    if "P2" in blocks:
        _eye_into(l1.wq, q_rows, blocks["P1"], lam)
        _eye_into(l1.wk, k_rows, blocks["P2"], lam)
    _eye_into(l1.wv, range(kv * hd, kv * hd + de), blocks["E"], 1.0 / gain1)
    _eye_into(l1.wo, range(*blocks["C"]), (0, de), 1.0)
    l1.write()
    head = model.get_output_embeddings().weight  # (vocab, H)
    c0, c1 = blocks["C"]
    final_gain = math.sqrt(h / (n_blocks + 1))
    with torch.no_grad():
        head[:, c0:c1] = codes * (COPY_LOGIT / final_gain)
