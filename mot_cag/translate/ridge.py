"""Calibration and the closed-form ridge baseline.

From calibration prefills (source and target over the same texts) we collect, per translated target layer,
pairs of aligned, position-free source K/V rows ``x`` and native target K/V rows ``y``. They give

* the per-layer, per-channel normalisation every translator carries (means and scales of ``x`` and ``y``);
* a ridge regression ``y_n ≈ x_n A + p B + b`` per layer (``p``: target-position features for absolute
  targets), solved in closed form. It initialises the linear part of trained experts and, on its own, is the
  training-free baseline (:func:`fit_ridge_translator`, ``kind="ridge"``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from mot_cag.models.positions import rotate_keys
from mot_cag.translate.alignment import leading_unaligned
from mot_cag.translate.inject import source_window, target_embeddings
from mot_cag.translate.mot import MixtureOfTranslators, Translator, build_translator, position_features
from mot_cag.translate.spec import TranslatorSpec


def _target_rows(translator: Translator, ex) -> tuple[torch.Tensor, torch.Tensor]:
    """Native target K/V of the translated layers over the context, keys un-rotated: ``(n, T, W_tgt)`` each."""
    cfg = translator.config
    t = len(ex.tgt_ids)
    idx = torch.tensor(cfg.layers.target_layers, device=ex.native_full.keys.device)
    keys = ex.native_full.keys[idx, :, :t]  # (n, H, T, D)
    values = ex.native_full.values[idx, :, :t]
    if cfg.tgt.positions == "rope":
        pos = torch.arange(ex.start, ex.start + t, device=keys.device)
        keys = rotate_keys(keys, -pos, translator.tgt_inv_freq.to(keys.device))
    n, h, _, d = keys.shape
    return keys.permute(0, 2, 1, 3).reshape(n, t, h * d), values.permute(0, 2, 1, 3).reshape(n, t, h * d)


@torch.no_grad()
def collect(translator: Translator, examples: Iterable, tokens: int, target=None) -> dict[str, torch.Tensor]:
    """Gather ``tokens`` aligned rows: ``xk, xv`` ``(n, N, W_src)``, ``yk, yv`` ``(n, N, W_tgt)``, ``pos`` ``(N,)``
    and ``first`` ``(N,)`` (first translated row of each example), and ``emb`` ``(N, E)`` target embeddings
    when the translator reads them (``target`` must then be given)."""
    parts: dict[str, list[torch.Tensor]] = {"xk": [], "xv": [], "yk": [], "yv": [], "pos": [], "first": [],
                                            "emb": []}
    total = 0
    for ex in examples:
        skip = leading_unaligned(ex.W)  # target-only tokens are computed natively, not translated
        xk, xv = source_window(translator, ex.src_chunk, ex.W[skip:])
        yk, yv = _target_rows(translator, ex)
        for name, x in (("xk", xk), ("xv", xv), ("yk", yk[:, skip:]), ("yv", yv[:, skip:])):
            parts[name].append(x.float().cpu())
        n = len(ex.tgt_ids) - skip
        parts["pos"].append(torch.arange(ex.start + skip, ex.start + len(ex.tgt_ids)))
        parts["first"].append(torch.arange(n) == 0)  # where the previous-token features are zero
        emb = target_embeddings(translator, getattr(target, "model", target), ex.tgt_ids[skip:])
        if emb is not None:
            parts["emb"].append(emb.float().cpu())
        total += n
        if total >= tokens:
            break
    return {k: torch.cat(v, dim=0 if k in ("pos", "first", "emb") else 1) for k, v in parts.items() if v}


def _shift_rows(x: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
    """``(n, N, W)`` rows ``k`` back within each example (zero before an example's first row)."""
    idx = torch.arange(x.shape[1])
    start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=0).values  # example start per row
    out = torch.roll(x, k, dims=1)
    out[:, (idx - k) < start.to(idx.device)] = 0.0
    return out


def _side_rows(translator: Translator, data: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Side features ``(1, N, P)`` of the collected rows, built as at inference (per example for the
    previous-token embedding)."""
    cfg = translator.config
    if not cfg.side_features:
        return None
    emb = data.get("emb")
    if emb is not None and cfg.prev_token:
        # Translator.side shifts within one chunk; rows here concatenate examples, so shift per example.
        e = (emb - translator.emb_mean.cpu()) / translator.emb_std.cpu()
        if translator.emb_proj is not None:
            e = e @ translator.emb_proj.cpu()
        parts = []
        if cfg.pos_features:
            parts.append(position_features(data["pos"], cfg.pos_features, cfg.tgt.max_positions))
        parts += [e] + [_shift_rows(e.unsqueeze(0), data["first"], k)[0] for k in range(1, int(cfg.prev_token) + 1)]
        return torch.cat(parts, dim=-1).unsqueeze(0)
    return translator.side(data["pos"], emb, torch.device("cpu"), torch.float32)


def _set_stats(mix: MixtureOfTranslators, x: torch.Tensor, y: torch.Tensor) -> None:
    for prefix, data in (("in", x), ("out", y)):
        mean = data.mean(1, keepdim=True)  # (n, 1, W)
        std = data.std(1, keepdim=True)
        # Near-constant channels would blow up after division: floor them at 1% of the layer's typical scale.
        std = torch.maximum(std, 0.01 * std.mean(-1, keepdim=True)).clamp_min(1e-6)
        getattr(mix, f"{prefix}_mean").copy_(mean.to(mix.in_mean.device))
        getattr(mix, f"{prefix}_std").copy_(std.to(mix.in_mean.device))


def _fit(mix: MixtureOfTranslators, x: torch.Tensor, y: torch.Tensor, p: torch.Tensor | None, lam: float,
         first: torch.Tensor) -> float:
    """Solve the per-layer ridge in normalised space and write it into the mixture's shared linear map.

    Returns:
        Mean relative residual (residual energy / target energy) on the calibration rows.
    """
    dev = mix.in_mean.device
    xn = ((x.to(dev) - mix.in_mean) / mix.in_std).double()  # (n, N, W_in)
    yn = ((y.to(dev) - mix.out_mean) / mix.out_std).double()  # (n, N, W_out)
    n, rows, w_in = xn.shape
    feats = [xn]
    prev = mix.base.prev_count
    for k in range(1, prev + 1):  # previous rows; zero before an example starts, as at inference
        feats.append(_shift_rows(xn, first.to(dev), k))
    if p is not None:
        feats.append(p.to(dev).double().expand(n, -1, -1))  # (n, N, P)
    feats.append(torch.ones(n, rows, 1, dtype=torch.float64, device=dev))
    f = torch.cat(feats, dim=-1)  # (n, N, F)
    gram = f.transpose(1, 2) @ f  # (n, F, F)
    reg = lam * gram.diagonal(dim1=1, dim2=2).mean(-1)  # scale-aware ridge strength per layer
    eye = torch.eye(f.shape[-1], dtype=torch.float64, device=dev)
    eye[-1, -1] = 0.0  # do not shrink the bias
    sol = torch.linalg.solve(gram + reg[:, None, None] * eye, f.transpose(1, 2) @ yn)  # (n, F, W_out)
    resid = ((f @ sol - yn).pow(2).sum() / yn.pow(2).sum().clamp_min(1e-12)).item()
    sol = sol.float()
    base = mix.base
    base.linear.weight.data.copy_(sol[:, :w_in])
    base.linear.bias.data.copy_(sol[:, -1:])
    if prev:
        base.prev.weight.data.copy_(sol[:, w_in:(1 + prev) * w_in])
    if base.pos is not None and p is not None:
        base.pos.weight.data.copy_(sol[:, (1 + prev) * w_in:-1])
    return resid


@torch.no_grad()
def calibrate(
    translator: Translator, examples: Iterable, tokens: int = 4096, fit: bool = True, ridge_lambda: float = 1e-2,
    target=None,
) -> dict:
    """Set the translator's normalisation from calibration examples and, if ``fit``, its ridge linear part.

    Args:
        translator: Translator to calibrate in place.
        examples: Prepared examples (:class:`~mot_cag.translate.train.Example`).
        tokens: Target tokens to use.
        fit: Also solve the ridge regression into every expert's linear part.
        ridge_lambda: Ridge strength relative to the mean feature energy.
        target: Target loaded model (needed when the translator reads target embeddings).

    Returns:
        Summary: tokens used, and the relative residuals of the key and value fits when ``fit``.
    """
    t0 = time.time()
    data = collect(translator, examples, tokens, target)
    _set_stats(translator.keys, data["xk"], data["yk"])
    _set_stats(translator.values, data["xv"], data["yv"])
    if "emb" in data:
        dev = translator.emb_mean.device
        translator.emb_mean.copy_(data["emb"].mean(0, keepdim=True).to(dev))
        std = data["emb"].std(0, keepdim=True)
        translator.emb_std.copy_(torch.maximum(std, 0.01 * std.mean()).clamp_min(1e-6).to(dev))
        if translator.emb_proj is not None:
            e = (data["emb"] - translator.emb_mean.cpu()) / translator.emb_std.cpu()
            # Principal directions of the calibration tokens' embeddings (right singular vectors).
            _, _, vh = torch.linalg.svd(e.double(), full_matrices=False)
            translator.emb_proj.copy_(vh[: translator.emb_proj.shape[1]].T.float().to(dev))
    out = {"tokens": int(data["pos"].numel())}
    if fit:
        p = _side_rows(translator, data)
        out["key_residual"] = _fit(translator.keys, data["xk"], data["yk"], p, ridge_lambda, data["first"])
        out["value_residual"] = _fit(translator.values, data["xv"], data["yv"], p, ridge_lambda, data["first"])
    out["seconds"] = round(time.time() - t0, 2)
    return out


def fit_ridge_translator(source, target, examples: Iterable, tokens: int = 4096, ridge_lambda: float = 1e-2,
                         spec: TranslatorSpec | None = None, **fields) -> Translator:
    """The training-free baseline: one linear map per target layer, fitted in closed form.

    Args:
        source: Source loaded model.
        target: Target loaded model.
        examples: Prepared calibration examples (see :func:`~mot_cag.translate.train.example_stream`).
        tokens: Calibration tokens.
        ridge_lambda: Ridge strength.
        spec: What it covers and reads (coverage, window, token features, previous tokens, token rank); its
            kind is ``ridge`` whatever it says (one linear map, no experts).
        **fields: Instead of ``spec``, its fields.
    """
    spec = replace(spec, **fields) if spec is not None else TranslatorSpec(**fields)
    translator = build_translator(source, target, replace(spec, kind="ridge", expert="linear", experts=1, top_k=1))
    summary = calibrate(translator, itertools.islice(examples, 10_000), tokens, fit=True, ridge_lambda=ridge_lambda,
                        target=target)
    translator.config.training = {"method": "ridge", "calibration": summary, "ridge_lambda": ridge_lambda}
    return translator.eval()
