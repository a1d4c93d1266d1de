"""Joined chunk caches on a real model: every way of assembling the retrieved context, scored in one run.

One model is its own source and target. The corpus is ingested into a store (``--chunk-prefix prompt``) once;
each question retrieves its top-k chunks once, and every variant builds the target's context from the same
pieces and answers the same question, so the variants differ only by how the context cache was made:

- ``direct``: the target reads the retrieved text (one prefill): the quality reference;
- ``none``: no context: the floor of the context-benefit scores;
- ``alone``: each chunk prefilled alone from position 0, joined (what stores did before ``chunk_prefix``);
- ``prefix``: each chunk prefilled after the prompt head (kept once), joined;
- ``prefix+dev@R`` / ``prefix+start@R``: the same, then a fraction R of the context tokens recomputed against the
  whole joined cache (CacheBlend's deviation choice, or EPIC-like first tokens of every piece);
- ``stored`` / ``stored+dev@R``: the store's own chunk files (fp16, prefilled after the head at ingest) through
  ``mot-cag ask``'s path (translated mode with the source as target);
- ``VARIANT~temp@T``: that variant's context with attention temperature ``T`` over the pieces (APE-like).
- ``tr:INJECTION`` / ``tr:INJECTION+dev@R`` (with ``--source``): the store's chunks, made by another model,
  translated (``direct``, ``replay``, ``replay-joint``) by ``--translator`` (default: the one found for the pair);
  ``tr:replay-joint@W``: replay over the joined context with the top share W of the target's layers translated.

Scores per variant: exact match, contains-answer, F1, answer NLL, KL(direct || variant), mean TTFT; and the
retention of each against direct: EM and contains ratios, ``kl_benefit = 1 - KL_v / KL_none`` and
``nll_benefit``. Per-example rows go to ``OUT.jsonl`` as they finish (a rerun resumes), the summary to
``OUT.json`` and a markdown table to stdout.

Usage::

    python benchmarks/chunk_variants.py --model qwen2.5-coder-0.5b --corpus DIR --store STORE --out OUT \
        [--limit N] [--top-k 4] [--variants direct,none,alone,prefix,prefix+dev@0.1,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_VARIANTS = ("direct,none,alone,prefix,prefix+dev@0.05,prefix+dev@0.1,prefix+dev@0.15,prefix+dev@0.3,"
                    "prefix+start@0.15,stored,stored+dev@0.15")


class TemperedContext:
    """A builder's context with the keys of every token after the prompt head divided by ``t``: each query's
    logits over the retrieved pieces are those of attention temperature ``t`` (RoPE rotation is linear, so
    scaling a rotated key scales its logit), while the head (the attention sink) and the question keep theirs.
    APE (arXiv 2502.05431) sharpens the attention over separately encoded contexts this way."""

    def __init__(self, inner, t: float):
        self.inner, self.t = inner, t

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def build(self, pieces):
        from dataclasses import replace

        from mot_cag.models.cache import KVChunk

        ctx = self.inner.build(pieces)
        if ctx.kv is None:
            return ctx
        keys = ctx.kv.keys.clone()
        keys[:, :, len(self.inner.head):] /= self.t
        return replace(ctx, kv=KVChunk(keys, ctx.kv.values, ctx.kv.start))


def build_variant(name: str, target, store_prefix: tuple[int, ...], caches: dict, source=None,
                  translator: str | None = None):
    """The context builder a variant name stands for (variants of one base share its per-piece cache, so a
    piece is prefilled once per base, whatever the repair after it). ``tr:INJECTION`` variants translate the
    store's chunks (made by ``source``) with ``translator``."""
    from mot_cag.pipeline.context import LRU, DirectContext, NativeChunksContext, NoneContext, Recompute
    from mot_cag.pipeline.translation import translated_builder

    if name == "direct":
        return DirectContext(target)
    if name == "none":
        return NoneContext(target)
    if "~temp@" in name:  # attention temperature on the pieces: NAME~temp@T (APE-like; experiment, not a default)
        inner, _, t = name.partition("~temp@")
        return TemperedContext(build_variant(inner, target, store_prefix, caches, source, translator), float(t))
    base, _, repair = name.partition("+")
    recompute = Recompute(0.0)  # explicit: no repair unless the variant names one
    if repair:
        policy, _, ratio = repair.partition("@")
        recompute = Recompute(float(ratio), {"dev": "deviation"}.get(policy, policy))
    cache = caches.setdefault(base, LRU())
    if base == "alone":
        return NativeChunksContext(target, cache, recompute=recompute, prefixed=False)
    if base == "prefix":
        return NativeChunksContext(target, cache, recompute=recompute, prefixed=True)
    if base == "stored":
        return translated_builder(target, target, cache=cache, recompute=recompute, chunk_prefix=store_prefix)
    if base.startswith("tr:"):
        injection, _, window = base[3:].partition("@")
        cache = caches.setdefault(f"tr:{injection}", LRU())  # translated pieces do not depend on the window
        return translated_builder(source, target, translator, injection, cache=cache, recompute=recompute,
                                  chunk_prefix=store_prefix, window=float(window) if window else None)
    raise SystemExit(f"unknown variant {name!r}")


def summarize(rows: list[dict], variants: list[str]) -> dict:
    """Per-variant means and retention against direct."""
    out: dict = {}
    for v in variants:
        rs = [r[v] for r in rows if v in r]
        if not rs:
            continue
        mean = {k: sum(x[k] for x in rs) / len(rs) for k in ("exact_match", "contains", "f1", "nll", "kl_to_direct",
                                                              "ttft_s")}
        mean["n"] = len(rs)
        out[v] = mean
    d, n = out.get("direct"), out.get("none")
    for m in out.values():
        if d is None:
            break
        m["em_retention"] = m["exact_match"] / d["exact_match"] if d["exact_match"] else None
        m["contains_retention"] = m["contains"] / d["contains"] if d["contains"] else None
        if n is not None:
            m["kl_benefit"] = 1 - m["kl_to_direct"] / n["kl_to_direct"] if n["kl_to_direct"] else None
            gap = n["nll"] - d["nll"]
            m["nll_benefit"] = (n["nll"] - m["nll"]) / gap if gap else None
    return out


def table(summary: dict, title: str) -> str:
    def f(x, p=3):
        return "-" if x is None else f"{x:.{p}f}"

    lines = [f"### {title}", "",
             "| variant | n | EM | contains | EM ret. | contains ret. | kl_benefit | nll_benefit | KL to direct | "
             "TTFT s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v, m in summary.items():
        lines.append(f"| {v} | {m['n']} | {f(m['exact_match'])} | {f(m['contains'])} | {f(m.get('em_retention'))} | "
                     f"{f(m.get('contains_retention'))} | {f(m.get('kl_benefit'))} | {f(m.get('nll_benefit'))} | "
                     f"{f(m['kl_to_direct'])} | {f(m['ttft_s'], 2)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target (and the store's source unless --source)")
    ap.add_argument("--source", default=None, help="the store's source model, for tr:INJECTION variants")
    ap.add_argument("--translator", default=None, help="translator folder for tr:* variants (default: found)")
    ap.add_argument("--corpus", required=True, help="a folder written by `mot-cag data corpus`")
    ap.add_argument("--store", required=True, help="store folder (ingested with --chunk-prefix prompt if absent)")
    ap.add_argument("--out", required=True, help="output path without suffix (.jsonl rows, .json summary)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--offset", type=int, default=0, help="skip the first N questions (another slice of a corpus)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mot_cag.evaluation.datasets import load_examples
    from mot_cag.evaluation.scoring import Evaluator
    from mot_cag.ingest import ingest
    from mot_cag.models.registry import load_model
    from mot_cag.pipeline.retrieval import store_pieces_for
    from mot_cag.store.store import Store

    corpus = Path(args.corpus)
    if not Store.exists(args.store):
        t0 = time.perf_counter()
        res = ingest([corpus / "docs"], args.store, args.source or args.model, chunk_prefix="prompt")
        print(f"ingested {res.chunks_added} chunks in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    prefix = Store.read_config(args.store).prefix_ids
    target = load_model(args.model)
    source = load_model(args.source, weights=False) if args.source else target
    variants = [v for v in args.variants.split(",") if v]
    caches: dict = {}
    builders = {v: build_variant(v, target, prefix, caches, source, args.translator) for v in variants}
    evaluator = Evaluator(target, builders)
    pieces_for = store_pieces_for(args.store, args.top_k, source=source)
    examples = load_examples(str(corpus / "questions.jsonl"))[args.offset:]
    examples = examples[: args.limit] if args.limit else examples

    rows_path = Path(args.out + ".jsonl")
    done = {}
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done[r["id"]] = r
    with rows_path.open("a") as fh:
        for i, ex in enumerate(examples):
            if str(ex["id"]) in done:
                continue
            t0 = time.perf_counter()
            pieces, hit = pieces_for(ex)
            row: dict = {"id": str(ex["id"]), "answer": ex["answer"], "recall": hit,
                         "context_tokens": None}
            for r in evaluator.run_example(ex, pieces):
                row[r.mode] = {"prediction": r.prediction, "exact_match": r.exact_match, "contains": r.contains,
                               "f1": r.f1, "nll": r.nll, "kl_to_direct": r.kl_to_direct, "ttft_s": r.ttft_s}
                row["context_tokens"] = r.context_tokens
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            done[row["id"]] = row
            print(f"[{i + 1}/{len(examples)}] {time.perf_counter() - t0:.1f} s  {ex['answer']!r}: "
                  + "  ".join(f"{v}={row[v]['prediction']!r}" for v in variants if v in row), file=sys.stderr)
    rows = [done[str(ex["id"])] for ex in examples if str(ex["id"]) in done]
    summary = summarize(rows, variants)
    recall = [r["recall"] for r in rows if r["recall"] is not None]
    tokens = [r["context_tokens"] for r in rows if r["context_tokens"]]
    report = {"model": args.model, "corpus": str(corpus), "store": args.store, "top_k": args.top_k, "n": len(rows),
              "retrieval_recall": sum(recall) / len(recall) if recall else None,
              "mean_context_tokens": sum(tokens) / len(tokens) if tokens else None, "variants": summary}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    print(table(summary, f"{args.model}, {len(rows)} questions, top-k {args.top_k}, recall "
                         f"{report['retrieval_recall']}, mean context {report['mean_context_tokens']:.0f} tokens"))


if __name__ == "__main__":
    main()
