"""Translation cost per context token relative to the target's own prefill, same run, for each pair.

For every ordered (source, target) pair it times, on the same context and device:

* ``prefill``: the target prefilling the context text itself (the cost translation avoids);
* ``align``: the cross-tokenizer alignment alone (included in the next two);
* ``direct``: alignment + MoT translation of the source cache into every target layer;
* ``replay``: the same translation, then the target re-running over the context with the window substituted.

and prints milliseconds per context token and the ratio to prefill. The source's own prefill is not counted:
in CAG it is paid once at ingest. Translators come from ``find_translator`` when one exists for the pair, else
a fresh default one (same architecture and cost, untrained).

Usage::

    python benchmarks/bench_translate.py                       # zoo models when present, else tiny models
    python benchmarks/bench_translate.py --models gpt2-mini opt-mini --tokens 512 --device cuda --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _context(tokens: int, tokenizer) -> str:
    from mot_cag.data.synthetic import synth_dataset

    text = ""
    seed = 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " ".join(ex["context"] for ex in synth_dataset("qa", 4, seed=seed)) + " "
        seed += 1
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _default_models() -> list[str]:
    from mot_cag.models.registry import zoo_names

    names = [n for n in ("gpt2-mini", "opt-mini", "qwen2-mini") if n in zoo_names()]
    if len(names) >= 2:
        return names
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny

    root = Path(tempfile.mkdtemp(prefix="bench-tiny-"))
    print("zoo models not present: benchmarking tiny random models", file=sys.stderr)
    return [str(tiny.build(f, root / f"tiny-{f}")) for f in ("gpt2", "opt", "qwen2")]


def bench_pair(source, target, tokens: int, repeats: int, translator: str | None = None) -> dict:
    """Median timings of one pair (see the module docstring); ``translator``: a folder instead of the one found."""
    from mot_cag.errors import TranslatorError
    from mot_cag.models.cache import prefill
    from mot_cag.translate.alignment import token_alignment
    from mot_cag.translate.checkpoint import find_translator, load_translator
    from mot_cag.translate.inject import translate
    from mot_cag.translate.mot import build_translator

    try:
        tr = load_translator(translator or find_translator(source.name, target.name), source, target)
        origin = Path(translator).name if translator else "trained"
    except TranslatorError:
        tr = build_translator(source, target).eval()
        origin = "fresh"
    text = _context(tokens, source.tokenizer)
    al = token_alignment(source.tokenizer, target.tokenizer, text)
    chunk = prefill(source.model, al.src_ids.to(source.device))
    tgt_ids = al.tgt_ids.to(target.device)

    def direct():
        a = token_alignment(source.tokenizer, target.tokenizer, text)
        translate(tr, chunk, a.W, target, tgt_ids, injection="inject-all")

    def replay():
        a = token_alignment(source.tokenizer, target.tokenizer, text)
        translate(tr, chunk, a.W, target, tgt_ids, injection="replay")

    with torch.no_grad():
        t_prefill = _time(lambda: prefill(target.model, tgt_ids), repeats)
        t_align = _time(lambda: token_alignment(source.tokenizer, target.tokenizer, text), repeats)
        t_direct = _time(direct, repeats)
        t_replay = _time(replay, repeats)
    n = len(al.tgt_ids)
    return {"source": source.name, "target": target.name, "translator": origin, "kind": tr.config.kind,
            "context_tokens": n, "prefill_ms_per_token": 1e3 * t_prefill / n,
            "align_ms_per_token": 1e3 * t_align / n, "direct_ms_per_token": 1e3 * t_direct / n,
            "replay_ms_per_token": 1e3 * t_replay / n,
            "direct_vs_prefill": t_direct / t_prefill, "replay_vs_prefill": t_replay / t_prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="Models to pair (default: zoo gpt2/opt/qwen2-mini, else tiny).")
    ap.add_argument("--tokens", type=int, default=256, help="Context length in source tokens.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (ignored on CUDA).")
    ap.add_argument("--translator", nargs="*", default=None,
                    help="Translator folders of one pair (--models SOURCE TARGET), timed one after another in this "
                         "process against the same target prefill (e.g. a trained mixture vs the ridge baseline).")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.translator and len(args.models or []) != 2:
        ap.error("--translator needs --models SOURCE TARGET")

    from mot_cag.device import pick_device
    from mot_cag.models.registry import load_model

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    names = args.models or _default_models()
    models = {n: load_model(n, device=device) for n in names}
    # Another tokenizer may need more tokens for the same text: stay well inside every position table.
    args.tokens = min(args.tokens, min(m.layout.max_positions for m in models.values()) // 2)
    if args.translator:
        rows = [bench_pair(models[names[0]], models[names[1]], args.tokens, args.repeats, tr) for tr in args.translator]
    else:
        rows = [bench_pair(models[s], models[t], args.tokens, args.repeats) for s in names for t in names if s != t]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"device {device}, threads {torch.get_num_threads()}, {args.tokens} source tokens, "
          f"median of {args.repeats}")
    print(f"{'source':>14} {'target':>14} {'translator':>10} {'prefill ms/tok':>15} {'align ms/tok':>13} "
          f"{'direct ms/tok':>14} "
          f"{'direct/prefill':>15} {'replay/prefill':>15}")
    for r in rows:
        print(f"{Path(r['source']).name:>14} {Path(r['target']).name:>14} {r['translator']:>10} "
              f"{r['prefill_ms_per_token']:>15.4f} {r['align_ms_per_token']:>13.4f} "
              f"{r['direct_ms_per_token']:>14.4f} "
              f"{r['direct_vs_prefill']:>15.2f} {r['replay_vs_prefill']:>15.2f}")


if __name__ == "__main__":
    main()
