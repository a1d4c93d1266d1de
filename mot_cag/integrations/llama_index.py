"""llama-index integration: a retriever over a mot-cag store, and a query engine that answers from the
retrieved chunks' KV caches (translated into the chosen target's cache space) instead of their text.

Works offline: nothing here touches ``Settings.llm`` or ``Settings.embed_model``; the store embeds queries
with its own embedder. Use :class:`MotCagRetriever` wherever llama-index takes a retriever (e.g.
``RetrieverQueryEngine``), and :class:`MotCagQueryEngine` to answer without prefilling the retrieved text.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import ConfigDict, Field, PrivateAttr

from mot_cag.pipeline.retrieval import open_store


class MotCagRetriever(BaseRetriever):
    """Retrieves chunks of a mot-cag store as ``NodeWithScore`` (text, score and chunk metadata).

    Args:
        store: Store folder (or an open :class:`~mot_cag.store.store.Store`).
        top_k: Chunks per query.
    """

    def __init__(self, store, top_k: int = 4, **kwargs: Any):
        super().__init__(**kwargs)
        self.store = open_store(store) if isinstance(store, str) else store
        self.top_k = top_k
        self.last_hits: list = []

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self.store.search(query_bundle.query_str, k=self.top_k)
        self.last_hits = hits
        return [NodeWithScore(node=hit_to_node(h, self.store.source.name), score=h.score) for h in hits]


def hit_to_node(hit, source_model: str) -> TextNode:
    """A llama-index node for a store hit; the chunk key is the node id and in the metadata."""
    return TextNode(
        id_=hit.key,
        text=hit.text,
        metadata={"chunk_key": hit.key, "doc": hit.doc, "chunk": hit.chunk_index, "source_model": source_model,
                  "char_start": hit.char_start, "char_end": hit.char_end},
        excluded_embed_metadata_keys=["chunk_key", "source_model", "char_start", "char_end"],
        excluded_llm_metadata_keys=["chunk_key", "source_model", "char_start", "char_end"],
    )


class MotCagQueryEngine(CustomQueryEngine):
    """Answers from the retrieved chunks' KV caches with one target model.

    Build with :meth:`from_store`; ``query("...")`` returns a ``Response`` whose ``source_nodes`` are the
    retrieved chunks and whose ``metadata`` holds the mode, models, timings and context size.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    retriever: MotCagRetriever = Field(description="Retriever over the store.")
    _asker: Any = PrivateAttr()

    @classmethod
    def from_store(cls, store: str, target: str, mode: str = "translated", top_k: int = 4, device: str = "cpu",
                   translator: str | None = None, max_new_tokens: int = 48) -> MotCagQueryEngine:
        """Open the store, load the target (and translator) once."""
        from mot_cag.pipeline.ask import Asker

        asker = Asker(store, target, mode=mode, device=device, translator=translator,
                      max_new_tokens=max_new_tokens)
        engine = cls(retriever=MotCagRetriever(asker.store, top_k=top_k))
        engine._asker = asker
        return engine

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        res = self._asker.ask(query_str, hits=list(self.retriever.last_hits))
        meta = {"mode": res.mode, "target": res.target, "source": res.source, "timings": res.timings,
                "context_tokens": res.context_tokens}
        return Response(response=res.answer, source_nodes=nodes, metadata=meta)
