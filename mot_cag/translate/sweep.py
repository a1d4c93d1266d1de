"""The translator results table: pairs x injection modes x variants, and the early-vs-late injection sweep.

Every variant is trained (or fitted) on the synthetic training split and scored on held-out pairs (eval split
of invented strings, a seed training never uses) with :func:`~mot_cag.translate.train.evaluate_translator`:
``kl_benefit`` = 1 - KL(native || translated) / KL(native || none) and ``nll_benefit``, in both injection
modes. Variants:

* ``mot``: K experts, CCL + 5 x KL (the shipped default);
* ``single``: K = 1, same losses;
* ``ridge``: closed-form per-layer linear map, no training;
* ``ce``, ``ccl``, ``ce+ccl``, ``kl``: loss ablations of ``mot`` (``ce+ccl`` is the paper's loss);
* ``window@S``: replay-only translators injecting one target layer starting at ``S`` (the sweep).

Usage::

    python -m mot_cag.translate.sweep --models gpt2-mini opt-mini qwen2-mini --steps 200 \\
        --out mot_cag/zoo/translators/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mot_cag.names import COVERAGES
from mot_cag.translate.mot import build_translator
from mot_cag.translate.recipe import heldout_pairs
from mot_cag.translate.ridge import fit_ridge_translator
from mot_cag.translate.train import TrainConfig, evaluate_translator, example_stream, train_translator

VARIANTS = ("mot", "single", "ridge", "ce", "ccl", "ce+ccl", "kl")
LOSSES = {"mot": (0.0, 1.0, 5.0), "single": (0.0, 1.0, 5.0), "ce": (1.0, 0.0, 0.0), "ccl": (0.0, 1.0, 0.0),
          "ce+ccl": (1.0, 1.0, 0.0), "kl": (0.0, 0.0, 5.0)}


def run_variant(source, target, variant: str, steps: int, pairs, hidden: int = 128, seed: int = 0,
                token_features: bool = False, prev_token: int = 0) -> dict:
    """Train/fit one variant and score it in the injection modes it supports."""
    t0 = time.time()
    extra = {"token_features": token_features, "prev_token": prev_token}
    cfg = TrainConfig(steps=steps, seed=seed, log_every=max(1, steps))
    if variant == "ridge":
        tr = fit_ridge_translator(source, target, example_stream(source, target, cfg), cfg.calibration_tokens,
                                  **extra)
        ways = COVERAGES
    elif variant.startswith("window@"):
        start = int(variant.split("@")[1])
        tr = build_translator(source, target, coverage="replay", expert="attn", experts=4, top_k=2, hidden=hidden,
                              window_start=start, window_width=1, **extra)
        train_translator(tr, source, target, cfg)
        ways = ("replay",)
    else:
        cfg.ce, cfg.ccl, cfg.kl = LOSSES[variant]
        experts = 1 if variant == "single" else 4
        tr = build_translator(source, target, expert="attn", experts=experts, top_k=min(2, experts), hidden=hidden,
                              **extra)
        train_translator(tr, source, target, cfg)
        ways = COVERAGES
    row = {"source": source.name, "target": target.name, "variant": variant,
           "steps": 0 if variant == "ridge" else steps,
           "params": tr.parameter_count(), "train_s": round(time.time() - t0, 1)}
    for way in ways:
        ev = evaluate_translator(tr, source, target, pairs, way)
        row[way] = {k: ev[k] for k in ("kl_benefit", "nll_benefit", "top1_agreement", "kl_translated", "n")}
    return row


def _scores(row: dict, coverage: str) -> dict:
    """A row's scores for one injection (rows written before the rename say ``direct`` for ``inject-all``)."""
    return row.get(coverage) or (row.get("direct") if coverage == "inject-all" else None) or {}


def to_markdown(rows: list[dict]) -> str:
    """The results table (one line per pair and variant)."""
    def f(v):
        return "–" if v is None else f"{v:.3f}"

    lines = ["| source | target | variant | steps | kl_benefit inject-all | kl_benefit replay | nll_benefit "
             "inject-all | nll_benefit replay | top-1 agree inject-all |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, p = _scores(r, "inject-all"), _scores(r, "replay")
        lines.append(f"| {Path(r['source']).name} | {Path(r['target']).name} | {r['variant']} | {r['steps']} | "
                     f"{f(d.get('kl_benefit'))} | {f(p.get('kl_benefit'))} | {f(d.get('nll_benefit'))} | "
                     f"{f(p.get('nll_benefit'))} | {f(d.get('top1_agreement'))} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    """kl_benefit per pair and variant, one panel per injection mode (PNG); ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pairs = sorted({(Path(r["source"]).name, Path(r["target"]).name) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / max(1, len(variants))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(pairs) + 4), 4), sharey=True)
    for ax, mode in zip(axes, COVERAGES, strict=True):
        for i, v in enumerate(variants):
            vals = []
            for s, t in pairs:
                r = next((r for r in rows if r["variant"] == v and Path(r["source"]).name == s
                          and Path(r["target"]).name == t), None)
                vals.append(_scores(r or {}, mode).get("kl_benefit") or 0.0)
            ax.bar([j + i * width for j in range(len(pairs))], vals, width, label=v)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(pairs))],
                      [f"{s}→{t}" for s, t in pairs], rotation=20, fontsize=8)
        ax.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{mode} injection")
        ax.set_ylim(0.0, 1.0)
    axes[0].set_ylabel("kl_benefit (held-out)")
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description="Translator results table and injection sweep.")
    ap.add_argument("--models", nargs="+", default=[])
    ap.add_argument("--pairs", nargs="*", help="Ordered pairs as SOURCE:TARGET (default: all ordered pairs).")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--sweep-pair", help="SOURCE:TARGET for the early-vs-late sweep (one window per layer).")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval", type=int, default=24, help="Held-out pairs.")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--token-features", action="store_true", help="Feed target token embeddings (see mot.py).")
    ap.add_argument("--prev-tokens", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", required=True, help="Output folder: results.json, results.md, results.png.")
    ap.add_argument("--replot", action="store_true", help="Only redraw results.md/png from results.json.")
    args = ap.parse_args()
    if args.replot:
        rows = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "results.md").write_text(to_markdown(rows))
        plot(rows, Path(args.out) / "results.png")
        return

    from mot_cag.device import pick_device
    from mot_cag.models.registry import load_model

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    models = {n: load_model(n, device=device) for n in args.models}
    pairs = [tuple(p.split(":")) for p in args.pairs] if args.pairs else \
        [(s, t) for s in args.models for t in args.models if s != t]
    held = heldout_pairs(args.eval)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save() -> None:
        (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out / "results.md").write_text(to_markdown(rows))

    jobs = [(s, t, v) for s, t in pairs for v in args.variants]
    if args.sweep_pair:
        s, t = args.sweep_pair.split(":")
        jobs += [(s, t, f"window@{i}") for i in range(models[t].layout.layers)]
    for s, t, v in jobs:
        rows.append(run_variant(models[s], models[t], v, args.steps, held, args.hidden,
                                token_features=args.token_features, prev_token=args.prev_tokens))
        print(json.dumps(rows[-1]), flush=True)
        save()
    plot(rows, out / "results.png")


if __name__ == "__main__":
    main()
