"""llama-index integration (issue [5]): async retrieval that overlaps, thread safety, node-id lookup instead of
shared state, similarity_top_k and Path stores, callback events, and RetrieverEvaluator with the public
node-id helper."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("llama_index.core")

DOCS = {
    "ana.txt": "Ana Brell was born in Corvale. Ana Brell works as a baker.",
    "tomas.txt": "Tomas Reddick lives in Ostrava. Tomas Reddick plays the cello.",
    "mira.txt": "Mira Hollen plays the violin. Mira Hollen is employed by Quorvex.",
    "ivo.txt": "Ivo Tesar studied geology. Ivo Tesar collects old maps.",
}
QUESTIONS = ["Where was Ana Brell born?", "Where does Tomas Reddick live?", "What does Mira Hollen play?",
             "What did Ivo Tesar study?"] * 2


@pytest.fixture(scope="module")
def docs_and_store(tiny_dir, tmp_path_factory):
    from mot_cag.ingest import ingest

    docs = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    store = tmp_path_factory.mktemp("store") / "s"
    ingest([docs], store=store, source=str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    return docs, store


def test_similarity_top_k_and_path_store(docs_and_store):
    from mot_cag.errors import MotCagError
    from mot_cag.integrations.llama_index import MotCagRetriever

    _, store = docs_and_store
    r = MotCagRetriever(store, similarity_top_k=2)  # a Path, llama-index's keyword
    nodes = r.retrieve("Where was Ana Brell born?")
    assert len(nodes) == 2 and nodes[0].node.metadata["doc"].endswith("ana.txt")
    assert len(MotCagRetriever(str(store), top_k=3).retrieve("Ana")) == 3
    with pytest.raises(MotCagError, match="disagree"):
        MotCagRetriever(store, top_k=2, similarity_top_k=3)


def test_threads_get_the_same_results_as_one_by_one(docs_and_store):
    from mot_cag.integrations.llama_index import MotCagRetriever

    _, store = docs_and_store
    r = MotCagRetriever(store, similarity_top_k=2)
    want = [[n.node.node_id for n in r.retrieve(q)] for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda q: [n.node.node_id for n in r.retrieve(q)], QUESTIONS))
    assert got == want


def test_async_gather_overlaps(docs_and_store, monkeypatch):
    from mot_cag.integrations.llama_index import MotCagRetriever

    _, store = docs_and_store
    r = MotCagRetriever(store, similarity_top_k=2)
    want = [[n.node.node_id for n in r.retrieve(q)] for q in QUESTIONS]
    real = r.store.search
    active, peak, lock = [0], [0], threading.Lock()

    def slow(*a, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        try:
            return real(*a, **kw)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(r.store, "search", slow)

    async def main():
        return await asyncio.gather(*(r.aretrieve(q) for q in QUESTIONS))

    t0 = time.perf_counter()
    got = asyncio.run(main())
    wall = time.perf_counter() - t0
    assert [[n.node.node_id for n in g] for g in got] == want
    assert peak[0] >= 4 and wall < 8 * 0.3 / 2  # a blocking _aretrieve would run them one after another


def test_query_engine_uses_its_own_nodes_and_reports_to_callbacks(tiny_dir, docs_and_store):
    from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler

    from mot_cag.integrations.llama_index import MotCagQueryEngine
    from mot_cag.pipeline.ask import Asker

    _, store = docs_and_store
    debug = LlamaDebugHandler()
    engine = MotCagQueryEngine.from_store(store, str(tiny_dir / "tiny-qwen2"), mode="native-chunks", top_k=2,
                                          max_new_tokens=4, callback_manager=CallbackManager([debug]))
    assert not hasattr(engine.retriever, "last_hits")
    q = "Where does Tomas Reddick live?"
    r = engine.query(q)
    direct = Asker(str(store), engine._asker.target, mode="native-chunks", max_new_tokens=4).ask(q, top_k=2)
    assert r.response == direct.answer
    assert [n.node.metadata["doc"] for n in r.source_nodes] == [c["doc"] for c in direct.chunks]
    assert debug.get_event_pairs(CBEventType.QUERY) and debug.get_event_pairs(CBEventType.RETRIEVE)

    async def both():
        return await asyncio.gather(engine.aquery(q), engine.aquery("Where was Ana Brell born?"))

    a, b = asyncio.run(both())
    assert a.response == r.response
    assert b.source_nodes[0].node.metadata["doc"].endswith("ana.txt")  # no chunks leaked between queries


def test_retriever_evaluator_with_node_ids_of_documents(docs_and_store):
    from llama_index.core.evaluation import RetrieverEvaluator

    from mot_cag.errors import MotCagError
    from mot_cag.integrations.llama_index import MotCagRetriever, node_ids_for_document

    docs, store = docs_and_store
    r = MotCagRetriever(store, similarity_top_k=2)
    ev = RetrieverEvaluator.from_metric_names(["hit_rate", "mrr"], retriever=r)
    ids = node_ids_for_document(store, docs / "ana.txt")
    assert ids and all(isinstance(i, str) for i in ids)
    res = ev.evaluate(query="Where was Ana Brell born?", expected_ids=ids)
    assert res.metric_vals_dict["hit_rate"] == 1.0 and res.metric_vals_dict["mrr"] == 1.0
    with pytest.raises(MotCagError, match="store ls"):
        node_ids_for_document(store, docs / "nope.txt")
