"""Time to first token: translated (or stored) caches vs the target reading the text (direct), same run.

    .venv/bin/python benchmarks/bench_ask.py [--source qwen2-mini] [--targets ...] [--lengths 1024 2048 4096]
        [--injection auto|inject-all|replay|replay-joint] [--recompute 0 0.15] [--policy deviation]

For each target and context length (retrieved tokens, in ~256-token chunks of synthetic documents), measures
the median over repeats of: direct (target prefills the text, then the first answer token), translated cold
(translate every chunk, assemble, first token) and translated warm (translated-chunk LRU hit), for each
``--recompute`` ratio (cross-chunk repair after assembly, part of both cold and warm). The source's chunks come
from a real store ingested beforehand (prefilled after the prompt head for real models, ``chunk_prefix`` auto)
and cold loads them from disk: that is the path of ``mot-cag ask`` (stored chunks as they are when the target is
the source model, translated otherwise). The question is read through the target's
prompt format (chat template for real instruct models). Prints ratios against direct, the KV bytes of the
assembled context and the process's peak RSS. Without a trained translator for a pair, an untrained one of the
same architecture is timed (the cost does not depend on the weights) and the row says so.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from mot_cag.data.synthetic import WorldBuilder, render_document
from mot_cag.models import cache as kv
from mot_cag.models.registry import load_model
from mot_cag.pipeline.context import LRU, DirectContext, Piece, Recompute
from mot_cag.pipeline.translation import translated_builder
from mot_cag.prompts import as_tensor, encode


def make_pieces(source, n_tokens: int, chunk_tokens: int = 256, seed: int = 0, with_kv: bool = True) -> list[Piece]:
    """Chunks of synthetic documents totalling about ``n_tokens`` source tokens, with source KV (prefilled alone
    at 0) when ``with_kv``."""
    import random

    wb = WorldBuilder(random.Random(seed))
    pieces, total = [], 0
    while total < n_tokens:
        text = ""
        while len(encode(source.tokenizer, text)) < chunk_tokens:
            text = (text + " " + render_document(wb.facts(1, 3))).strip()
        ids = encode(source.tokenizer, text)[:chunk_tokens]
        text = source.tokenizer.decode(ids)
        ids = encode(source.tokenizer, text)
        chunk = kv.prefill(source.model, as_tensor(ids)) if with_kv else None
        pieces.append(Piece(text, key=f"{seed}-{len(pieces)}", source_kv=lambda c=chunk: c))
        total += len(ids)
    return pieces


def store_pieces(source, pieces: list[Piece], root: str) -> tuple[list[Piece], tuple[int, ...]]:
    """The same texts ingested into a store at ``root`` by ``source``; pieces that load their KV from it, and
    the store's chunk prefix."""
    from pathlib import Path

    from mot_cag.ingest import ingest
    from mot_cag.store.store import Store

    docs = Path(root) / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(pieces):
        (docs / f"doc-{i:03d}.txt").write_text(p.text + "\n", encoding="utf-8")
    ingest([docs], Path(root) / "store", source.name, chunk_tokens=512, embedder="hash")
    store = Store.open(Path(root) / "store")
    out = []
    for doc in sorted(store.manifest.documents(), key=lambda d: d.path):
        for place in store.manifest.doc_chunks(doc.id):
            text = store.chunk_info(place.key).text
            out.append(Piece(text, key=place.key, source_kv=lambda k=place.key: store.load(k, dtype=torch.float32)))
    return out, store.config.prefix_ids


def first_token_s(target, builder, pieces, suffix) -> tuple[float, int]:
    t0 = time.perf_counter()
    ctx = builder.build(pieces)
    next(kv.greedy_tokens(target.model, as_tensor(suffix), ctx.kv, 1))
    elapsed = time.perf_counter() - t0
    return elapsed, ctx.kv.keys.numel() * 2 * ctx.kv.keys.element_size() if ctx.kv is not None else 0


def translator_for(source, target) -> tuple[str | None, str]:
    """The translator folder to time (``None``: the pair's own) and what it is."""
    if source.fingerprint == target.fingerprint:
        return None, "same model (stored chunks as they are)"
    from mot_cag.translate.checkpoint import find_translator, load_translator

    try:
        load_translator(find_translator(source.name, target.name), source, target)
        return None, "trained"
    except Exception:  # noqa: BLE001 - no trained translator: time an untrained one of the same shape
        import tempfile

        from mot_cag.translate.checkpoint import save_translator
        from mot_cag.translate.mot import build_translator

        tmp = tempfile.mkdtemp()
        save_translator(build_translator(source, target), tmp)
        return tmp, "untrained"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="qwen2-mini")
    parser.add_argument("--targets", nargs="+", default=["qwen2-mini", "qwen2-small", "opt-mini", "gpt2-mini"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--injection", default="auto", help="auto, inject-all, replay or replay-joint")
    parser.add_argument("--recompute", nargs="+", type=float, default=[0.0],
                        help="cross-chunk repair ratios to time (each one a row)")
    parser.add_argument("--policy", default="deviation", help="recompute policy: deviation, start or spread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    source = load_model(args.source)
    question = "Where was Ana Brell born?"
    print(f"source {source.name}; injection {args.injection}; recompute policy {args.policy}; median of "
          f"{args.repeats}; times in seconds")
    print(f"{'target':>20} {'tokens':>6} {'R':>5} {'direct':>8} {'transl':>8} {'warm':>8} {'tr/dir':>7} "
          f"{'warm/dir':>8} {'ctx MB':>7}  translator")
    for name in args.targets:
        target = load_model(name)
        path, status = translator_for(source, target)
        fmt = DirectContext(target).prompt
        suffix = encode(target.tokenizer, fmt.suffix_text(question, "Ana Brell was born in"))
        longest = target.layout.max_positions - len(suffix) - 16
        if target.layout.positions == "rope":
            # RoPE has no position table: longer contexts run (past the trained range: timing only).
            longest = max(longest, max(args.lengths))
        lengths = sorted({min(n, longest) for n in args.lengths})  # a too-long request runs at the longest
        for n in lengths:
            pieces = make_pieces(source, n, chunk_tokens=min(256, longest // 4), seed=n, with_kv=False)
            while pieces and sum(len(encode(target.tokenizer, p.text)) for p in pieces) > longest:
                pieces.pop()
            import tempfile

            tmp = tempfile.TemporaryDirectory()
            pieces, prefix = store_pieces(source, pieces, tmp.name)
            direct = DirectContext(target)
            first_token_s(target, direct, pieces, suffix)  # warm-up: allocator, kernels
            d = [first_token_s(target, direct, pieces, suffix)[0] for _ in range(args.repeats)]
            md = statistics.median(d)
            ntok = sum(len(encode(target.tokenizer, p.text)) for p in pieces)
            past = " (past the trained positions: timing only)" if ntok > target.layout.max_positions else ""
            for ratio in args.recompute:
                cache = LRU()
                translated = translated_builder(source, target, path, args.injection, cache,
                                                Recompute(ratio, args.policy), chunk_prefix=prefix)
                first_token_s(target, translated, pieces, suffix)
                t, w = [], []
                nbytes = 0
                for _ in range(args.repeats):
                    cache.clear()
                    elapsed, nbytes = first_token_s(target, translated, pieces, suffix)
                    t.append(elapsed)
                    w.append(first_token_s(target, translated, pieces, suffix)[0])
                mt, mw = statistics.median(t), statistics.median(w)
                print(f"{name:>20} {ntok:>6} {ratio:>5.2f} {md:>8.4f} {mt:>8.4f} {mw:>8.4f} {mt / md:>7.3f} "
                      f"{mw / md:>8.3f} {nbytes / 1e6:>7.2f}  {status}{past}", flush=True)
            tmp.cleanup()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this run: {peak:.0f} MB")


if __name__ == "__main__":
    main()
