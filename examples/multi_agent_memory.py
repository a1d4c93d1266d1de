"""Multi-agent memory: agents of three model families answer from ONE shared KV store.

    mot-cag ingest examples/corpus --pipeline pipelines/real.toml --store stores/demo-real
    python examples/multi_agent_memory.py --store stores/demo-real "Where was Cet Sor born?"

Each agent (a different target model) reads the same source-model caches, translated into its own cache
space, instead of keeping and prefilling a store of its own. The script reports each agent's answer and
time to first token, and the memory the shared store saves against one native store per agent.
"""

from __future__ import annotations

import argparse

from mot_cag.errors import MotCagError
from mot_cag.pipeline.ask import Asker

BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def kv_bytes_per_token(layout, dtype: str = "float16") -> int:
    """Bytes a model's cache takes per token: K and V of every layer."""
    return 2 * layout.layers * layout.kv_heads * layout.head_dim * BYTES[dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("--store", default="stores/demo-real")
    parser.add_argument("--agents", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"])
    parser.add_argument("--mode", default="translated")
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    try:
        agents = [Asker(args.store, name, mode=args.mode) for name in args.agents]
    except MotCagError as e:
        raise SystemExit(f"error: {e}") from None
    info = agents[0].store.info()
    shared = info["bytes"]
    per_agent = 0
    print(f"shared store: {info['chunks']} chunks, {info['tokens']} source tokens, {shared / 1e6:.2f} MB "
          f"({info['source']})")
    for agent in agents:
        res = agent.ask(args.question, top_k=args.top_k)
        # A native store for this agent holds about the same text in its own tokens and cache shape.
        own = kv_bytes_per_token(agent.target.layout, info["dtype"]) * info["tokens"]
        per_agent += own
        print(f"  {res.target:>12} ({res.mode}): {res.answer!r}  ttft {res.timings['ttft_s']:.3f}s; "
              f"its own store would take ~{own / 1e6:.2f} MB")
    print(f"memory: one shared store {shared / 1e6:.2f} MB vs one store per agent ~{per_agent / 1e6:.2f} MB "
          f"(saves {1 - shared / per_agent:.0%})")


if __name__ == "__main__":
    main()
