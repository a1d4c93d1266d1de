"""Ask a mot-cag store through llama-index, offline.

    python examples/llama_index_query.py --store stores/demo --target opt-mini "Where was Cet Sor born?"

The retriever is an ordinary llama-index retriever (it also plugs into RetrieverQueryEngine); the query engine
answers from the retrieved chunks' KV caches, translated into the target's cache space.
"""

from __future__ import annotations

import argparse

from llama_index.core import Settings
from llama_index.core.llms import MockLLM

from mot_cag.errors import MotCagError
from mot_cag.integrations.llama_index import MotCagQueryEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("--store", default="stores/default")
    parser.add_argument("--target", default="qwen2-mini")
    parser.add_argument("--mode", default="translated")
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    # Offline: no hub LLM or embedding model may be resolved implicitly.
    Settings.llm = MockLLM()
    Settings.embed_model = None
    try:
        engine = MotCagQueryEngine.from_store(args.store, args.target, mode=args.mode, top_k=args.top_k)
        response = engine.query(args.question)
    except MotCagError as e:
        raise SystemExit(f"error: {e}") from None
    print(response.response)
    for node in response.source_nodes:
        print(f"  [{node.score:.3f}] {node.node.metadata['doc']}#{node.node.metadata['chunk']}")
    t = response.metadata["timings"]
    print(f"  {response.metadata['mode']} {response.metadata['source']} -> {response.metadata['target']}, "
          f"ttft {t['ttft_s']:.3f}s")


if __name__ == "__main__":
    main()
