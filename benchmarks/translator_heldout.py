"""Held-out fidelity of several translators of one pair, in one process, on the same pairs.

For each translator folder: the target reads held-out continuations over the translated cache (inject-all), over
its own prefill and with no context (:func:`mot_cag.translate.train.evaluate_translator`); one JSON line per
translator with kl_benefit, nll_benefit, top-1 agreement and the parameter count. Held-out pairs are the eval
split of ``--data`` (fresh seed), so a trained translator and the ridge map it started from are scored alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/translator_heldout.py --source smollm2-135m --target gemma-3-270m \\
        mot_cag/zoo/translators/smollm2-135m__gemma-3-270m path/to/trained
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translators", nargs="+", help="translator folders of the pair")
    ap.add_argument("--source", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", default="real", help="held-out pairs of this kind (default: real)")
    ap.add_argument("--n", type=int, default=16, help="held-out pairs")
    ap.add_argument("--chunk-prefix", default="prompt", choices=("prompt", "none"),
                    help="prompt: contexts after each model's prompt head, as prefixed stores hold them")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from mot_cag.models.registry import load_model
    from mot_cag.translate.checkpoint import load_translator
    from mot_cag.translate.recipe import heldout_pairs
    from mot_cag.translate.train import Heads, evaluate_translator

    torch.set_num_threads(args.threads)
    source, target = load_model(args.source), load_model(args.target)
    heads = Heads.of(source, target) if args.chunk_prefix == "prompt" else None
    pairs = heldout_pairs(args.n, data=args.data)
    for folder in args.translators:
        tr = load_translator(folder, source, target)
        scores = evaluate_translator(tr, source, target, pairs, "inject-all", heads=heads)
        print(json.dumps({"translator": folder, "kind": tr.config.kind, "experts": tr.config.experts,
                          "params": tr.parameter_count(), **scores}), flush=True)


if __name__ == "__main__":
    main()
