"""llama-index integration: a retriever over a mot-cag store, and a query engine that answers from the
retrieved chunks' KV caches (translated into the chosen target's cache space) instead of their text.

Works offline: nothing here touches ``Settings.llm`` or ``Settings.embed_model``; the store embeds queries
with its own embedder. Use :class:`MotCagRetriever` wherever llama-index takes a retriever (e.g.
``RetrieverQueryEngine``), and :class:`MotCagQueryEngine` to answer without prefilling the retrieved text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import ConfigDict, Field, PrivateAttr

from mot_cag.errors import MotCagError
from mot_cag.pipeline.retrieval import open_store
from mot_cag.store.search import Hit


def _open(store):
    return open_store(str(store)) if isinstance(store, (str, Path)) else store


class MotCagRetriever(BaseRetriever):
    """Retrieves chunks of a mot-cag store as ``NodeWithScore`` (text, score and chunk metadata).

    Safe to share between threads and across concurrent ``aretrieve`` calls: it keeps no per-query state, and
    the async path runs the search in a worker thread so the event loop keeps serving.

    Args:
        store: Store folder (``str`` or ``Path``) or an open :class:`~mot_cag.store.store.Store`.
        similarity_top_k: Chunks per query (llama-index's name); ``top_k`` is accepted too. Default 4.
    """

    def __init__(self, store, top_k: int | None = None, similarity_top_k: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if top_k is not None and similarity_top_k is not None and top_k != similarity_top_k:
            raise MotCagError(f"top_k={top_k} and similarity_top_k={similarity_top_k} disagree; give one.")
        k = similarity_top_k if similarity_top_k is not None else top_k if top_k is not None else 4
        if k < 1:
            raise MotCagError(f"similarity_top_k must be at least 1, got {k}.")
        self.store = _open(store)
        self.similarity_top_k = k

    @property
    def top_k(self) -> int:
        return self.similarity_top_k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self.store.search(query_bundle.query_str, k=self.similarity_top_k)
        return [NodeWithScore(node=hit_to_node(h, self.store.source.name), score=h.score) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def hit_to_node(hit, source_model: str) -> TextNode:
    """A llama-index node for a store hit; the chunk key is the node id and in the metadata."""
    return TextNode(
        id_=hit.key,
        text=hit.text,
        metadata={"chunk_key": hit.key, "doc": hit.doc, "chunk": hit.chunk_index, "source_model": source_model,
                  "char_start": hit.char_start, "char_end": hit.char_end, "tokens": hit.tokens},
        excluded_embed_metadata_keys=["chunk_key", "source_model", "char_start", "char_end", "tokens"],
        excluded_llm_metadata_keys=["chunk_key", "source_model", "char_start", "char_end", "tokens"],
    )


def node_to_hit(store, node: NodeWithScore) -> Hit:
    """The store hit a retrieved node stands for, looked up by its node id (the chunk key).

    Raises:
        MotCagError: The node is not a chunk of ``store``.
    """
    key = node.node.node_id
    row = store.manifest.chunk(key)
    if row is None:
        raise MotCagError(f"Node {key} is not a chunk of store {store.root}; retrieve it with a MotCagRetriever "
                          "over the same store.")
    meta = node.node.metadata or {}
    places = store.manifest.places(key)
    doc, place = next(((d, p) for d, p in places if d == meta.get("doc")), places[0] if places else (None, None))
    if doc is None:
        raise MotCagError(f"Chunk {key} belongs to no document of store {store.root} any more; retrieve again.")
    return Hit(key, doc, place.index, float(node.score or 0.0), row.text, str(store.root / row.file),
               place.char_start, place.char_end, row.tokens)


def node_ids_for_document(store, path: str | Path) -> list[str]:
    """The node ids (chunk keys, in reading order) of an ingested document: the ``expected_ids`` that
    llama-index's ``RetrieverEvaluator`` compares retrieved node ids with.

    Raises:
        MotCagError: The document is not in the store.
    """
    st = _open(store)
    doc = st.manifest.document(str(Path(path).expanduser().resolve()))
    if doc is None:
        raise MotCagError(f"{path} is not a document of store {st.root}; `mot-cag store ls` lists them.")
    return [c.key for c in st.manifest.doc_chunks(doc.id)]


class MotCagQueryEngine(CustomQueryEngine):
    """Answers from the retrieved chunks' KV caches with one target model.

    Build with :meth:`from_store`; ``query("...")`` returns a ``Response`` whose ``source_nodes`` are the
    retrieved chunks and whose ``metadata`` holds the mode, models, timings and context size. The chunks
    answered from are the nodes retrieved for this very query (looked up by node id), so concurrent queries
    never see each other's chunks. Query and retrieval events go to the callback manager.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    retriever: MotCagRetriever = Field(description="Retriever over the store.")
    _asker: Any = PrivateAttr()

    @classmethod
    def from_store(cls, store, target: str, mode: str = "translated", top_k: int = 4, device: str = "cpu",
                   translator: str | None = None, max_new_tokens: int = 48,
                   callback_manager: CallbackManager | None = None) -> MotCagQueryEngine:
        """Open the store, load the target (and translator) once."""
        from mot_cag.pipeline.ask import Asker

        asker = Asker(_open(store), target, mode=mode, device=device, translator=translator,
                      max_new_tokens=max_new_tokens)
        cm = callback_manager or CallbackManager([])
        engine = cls(retriever=MotCagRetriever(asker.store, similarity_top_k=top_k, callback_manager=cm),
                     callback_manager=cm)
        engine._asker = asker
        return engine

    def _answer(self, query_str: str, nodes: list[NodeWithScore]) -> Response:
        hits = [node_to_hit(self.retriever.store, n) for n in nodes]
        res = self._asker.ask(query_str, hits=hits)
        meta = {"mode": res.mode, "target": res.target, "source": res.source, "timings": res.timings,
                "context_tokens": res.context_tokens}
        return Response(response=res.answer, source_nodes=nodes, metadata=meta)

    def custom_query(self, query_str: str) -> Response:
        with self.callback_manager.event(CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_str}) as ev:
            nodes = self.retriever.retrieve(query_str)
            response = self._answer(query_str, nodes)
            ev.on_end(payload={EventPayload.RESPONSE: response})
        return response

    async def acustom_query(self, query_str: str) -> Response:
        with self.callback_manager.event(CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_str}) as ev:
            nodes = await self.retriever.aretrieve(query_str)
            response = await asyncio.to_thread(self._answer, query_str, nodes)
            ev.on_end(payload={EventPayload.RESPONSE: response})
        return response
