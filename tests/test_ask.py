"""The ask path end to end on a tiny store, in each mode, plus its bad-input errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mot_cag.errors import MotCagError

DOCS = {
    "ana.txt": "Ana Brell was born in Corvale. Ana Brell works as a baker. The pet of Ana Brell is a cat.",
    "tomas.md": "# Tomas\nTomas Reddick lives in Pastowe. The access code of Tomas Reddick is 48213.",
    "mira.txt": "Mira Hollen plays the violin. Mira Hollen is employed by Quorvex.",
}
ASK_KEYS = {"answer", "target", "source", "mode", "chunks", "timings", "context_tokens"}
TIMING_KEYS = {"retrieve_s", "load_s", "translate_s", "prefill_s", "ttft_s", "total_s"}


@pytest.fixture(scope="module")
def tiny_store(tiny_dir, tmp_path_factory):
    from mot_cag.ingest import ingest

    docs = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    store = tmp_path_factory.mktemp("store") / "s"
    ingest([docs], store=store, source=str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    return store


@pytest.mark.parametrize("mode", ["translated", "direct", "native-chunks", "none"])
def test_ask_each_mode_same_model(tiny_dir, tiny_store, mode):
    """Target = source: translated mode uses the stored chunks as they are."""
    from mot_cag.pipeline.ask import Asker

    asker = Asker(str(tiny_store), str(tiny_dir / "tiny-qwen2"), mode=mode, max_new_tokens=4)
    res = asker.ask("Where was Ana Brell born?", top_k=2).to_dict()
    assert set(res) == ASK_KEYS and set(res["timings"]) == TIMING_KEYS
    assert res["mode"] == mode
    if mode == "none":
        assert res["chunks"] == [] and res["context_tokens"] == 0
    else:
        assert len(res["chunks"]) == 2 and res["context_tokens"] > 0
        assert any(c["doc"].endswith("ana.txt") for c in res["chunks"])


def test_translated_same_model_equals_native_chunks(tiny_dir, tiny_store):
    """Stored source chunks, used by the source model itself, equal its own separately-prefilled chunks
    (up to the fp16 storage), so both modes answer alike."""
    from mot_cag.pipeline.ask import Asker
    from mot_cag.pipeline.retrieval import hits_to_pieces

    target = str(tiny_dir / "tiny-qwen2")
    a = Asker(str(tiny_store), target, mode="translated")
    b = Asker(str(tiny_store), a.target, mode="native-chunks")
    hits = a.store.search("Where does Tomas Reddick live?", k=3)
    pieces = hits_to_pieces(a.store, hits)
    ta, tb = a.builder.build(pieces), b.builder.build(pieces)
    assert ta.tokens == tb.tokens
    assert (ta.kv.keys - tb.kv.keys).abs().max().item() < 2e-2  # fp16 storage of the stored chunks
    assert a.ask("Where does Tomas Reddick live?", top_k=3).answer == b.ask("Where does Tomas Reddick live?",
                                                                            top_k=3).answer


def test_ask_bad_inputs(tiny_dir, tiny_store, tmp_path):
    from mot_cag.pipeline.ask import Asker

    asker = Asker(str(tiny_store), str(tiny_dir / "tiny-qwen2"), mode="direct")
    with pytest.raises(MotCagError, match="empty"):
        asker.ask("   ")
    with pytest.raises(MotCagError, match="larger than the store"):
        asker.ask("Where?", top_k=999)
    with pytest.raises(MotCagError, match="No store"):
        Asker(str(tmp_path / "nothing"), str(tiny_dir / "tiny-qwen2"))
    with pytest.raises(MotCagError, match="translator"):
        Asker(str(tiny_store), str(tiny_dir / "tiny-gpt2"), mode="translated")


def test_ask_cli_json_and_errors(tiny_dir, tiny_store):
    base = [sys.executable, "-m", "mot_cag.cli", "ask", "--store", str(tiny_store), "--device", "cpu"]
    proc = subprocess.run(base + ["Who employs Mira Hollen?", "--target", str(tiny_dir / "tiny-qwen2"),
                                  "--mode", "direct", "--top-k", "1", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert set(res) == ASK_KEYS and len(res["chunks"]) == 1
    assert set(res["chunks"][0]) == {"doc", "chunk", "score", "text"}
    for args in (["", "--target", str(tiny_dir / "tiny-qwen2")], ["Where?", "--target", "no-such-model"],
                 ["Where?", "--target", str(tiny_dir / "tiny-opt")],
                 ["Where?", "--target", str(tiny_dir / "tiny-qwen2"), "--injection", "sideways"]):
        proc = subprocess.run(base + args, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0, args
        assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:"), (args, proc.stderr)


def test_eval_over_store_reports_recall(tiny_dir, tiny_store, tmp_path):
    data = tmp_path / "q.jsonl"
    rows = [{"id": "1", "context": "", "question": "Where was Ana Brell born?", "answer": "Corvale",
             "cue": "Ana Brell was born in", "doc": "ana.txt"},
            {"id": "2", "context": "", "question": "What is the access code of Tomas Reddick?", "answer": "48213",
             "cue": "The access code of Tomas Reddick is", "doc": "tomas.md"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "mot_cag.cli", "eval", "--dataset", str(data), "--store",
                           str(tiny_store), "--target", str(tiny_dir / "tiny-qwen2"), "--top-k", "2", "--json",
                           "--device", "cpu", "--details", str(tmp_path / "d.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert set(rep["modes"]) == {"translated", "direct", "native-chunks", "none"}
    assert rep["modes"]["direct"]["retrieval_recall"] == 1.0
    assert rep["retention"] is not None and "kl_benefit" in rep["retention"]
    details = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    for d in details:  # each row names the documents its context came from
        assert len(d["retrieved_docs"]) == 2, d
        want = next(r["doc"] for r in rows if r["id"] == d["id"])
        assert any(doc.endswith(want) for doc in d["retrieved_docs"]), d


def test_llama_index_retriever_inside_retriever_query_engine(tiny_dir, tiny_store):
    from llama_index.core import Settings
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine

    from mot_cag.integrations.llama_index import MotCagQueryEngine, MotCagRetriever

    Settings.embed_model = None
    retriever = MotCagRetriever(str(tiny_store), top_k=2)
    nodes = retriever.retrieve("Where does Tomas Reddick live?")
    assert len(nodes) == 2 and nodes[0].node.metadata["doc"].endswith("tomas.md")
    assert nodes[0].node.metadata["chunk_key"] == nodes[0].node.node_id
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
    response = engine.query("Where does Tomas Reddick live?")
    assert {n.node.node_id for n in response.source_nodes} == {n.node.node_id for n in nodes}
    kv_engine = MotCagQueryEngine.from_store(str(tiny_store), str(tiny_dir / "tiny-qwen2"), mode="native-chunks",
                                             top_k=2, max_new_tokens=4)
    r = kv_engine.query("Where does Tomas Reddick live?")
    assert isinstance(r.response, str) and len(r.source_nodes) == 2
    assert r.metadata["mode"] == "native-chunks" and r.metadata["context_tokens"] > 0
