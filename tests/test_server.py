"""mot-cag serve: OpenAI-compatible answers equal to ``ask``, streaming, errors as JSON, admission (503),
warm models, and a killed server leaves the store intact."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from mot_cag.config import PipelineConfig  # noqa: E402

DOCS = {
    "ana.txt": "Ana Brell was born in Velmora. Ana Brell works as a potter.",
    "tomas.txt": "Tomas Reddick lives in Ostrava. Tomas Reddick plays the cello.",
    "mira.txt": "Mira Hollen studied chemistry. Mira Hollen lives in Tarnow.",
}
QUESTION = "Where was Ana Brell born?"


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    from mot_cag.ingest import ingest

    docs = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    path = tmp_path_factory.mktemp("store") / "s"
    ingest([docs], store=path, source=str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    return path


@pytest.fixture(scope="module")
def target(tiny_dir):
    return str(tiny_dir / "tiny-qwen2")


@pytest.fixture(scope="module")
def app(store, target):
    from mot_cag.server import create_app

    cfg = PipelineConfig(source=target, store=str(store), targets=[target], max_new_tokens=6, top_k=2)
    return create_app(cfg, device="cpu", max_pending=4)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_completion_equals_ask(client, store, target):
    from mot_cag.pipeline.ask import Asker

    want = Asker(str(store), target, max_new_tokens=6).ask(QUESTION, top_k=2)
    r = client.post("/v1/chat/completions", json={"model": target, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == want.target
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": want.answer}
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert [c["doc"] for c in body["mot_cag"]["chunks"]] == [c["doc"] for c in want.chunks]
    assert body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]

    r = client.post("/v1/completions", json={"model": target, "prompt": QUESTION})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.answer


def test_stream_events_add_up_to_the_answer(client, target):
    plain = client.post("/v1/chat/completions", json={"model": target,
                                                      "messages": [{"role": "user", "content": QUESTION}]}).json()
    r = client.post("/v1/chat/completions", json={"model": target, "stream": True,
                                                  "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    last = events[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["mot_cag"]["answer"] == plain["choices"][0]["message"]["content"]
    assert streamed.strip().startswith(last["mot_cag"]["answer"][:1])  # zoo 'qa' answers are the streamed line
    assert streamed.strip() == last["mot_cag"]["answer"]


def test_retrieve_models_health(client, target):
    r = client.post("/v1/retrieve", json={"query": QUESTION, "top_k": 2})
    assert r.status_code == 200
    data = r.json()["data"]
    assert len(data) == 2 and data[0]["doc"].endswith("ana.txt")
    assert {"doc", "chunk", "score", "text", "key"} <= set(data[0])
    assert r.json()["data"][0]["score"] >= data[1]["score"]
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["pending"] == 0
    assert client.get("/v1/models").json()["object"] == "list"


@pytest.mark.parametrize("payload, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "role 'user'"),
    ({"messages": [{"role": "user", "content": "hi"}], "mot_cag": {"mode": "telepathy"}}, 400, "mode"),
    ({"messages": [{"role": "user", "content": "hi"}], "mot_cag": {"colour": 1}}, 400, "colour"),
    ({"messages": [{"role": "user", "content": "hi"}], "mot_cag": {"store": "/nonexistent/s"}}, 400, "No store"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model-xyz"}, 400, "no-such-model-xyz"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "empty"),
])
def test_malformed_requests_get_json_errors(client, payload, status, words):
    kw = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(payload, bytes) \
        else {"json": payload}
    r = client.post("/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and "Traceback" not in r.text
    assert client.get("/v1/nothing").json()["error"]["code"] == 404


def test_full_server_answers_503_and_recovers(store, target):
    from mot_cag.server import Engine, create_app

    cfg = PipelineConfig(source=target, store=str(store), targets=[target], max_new_tokens=4, top_k=2)
    eng = Engine(cfg, "cpu")
    gate, entered = threading.Event(), threading.Event()
    real = eng.answer

    def slow(*a, **kw):
        entered.set()
        gate.wait(30)
        return real(*a, **kw)

    eng.answer = slow
    app = create_app(cfg, engine=eng, max_pending=1)
    body = {"model": target, "messages": [{"role": "user", "content": QUESTION}]}
    with TestClient(app) as c:
        first: dict = {}
        t = threading.Thread(target=lambda: first.setdefault("r", c.post("/v1/chat/completions", json=body)))
        t.start()
        assert entered.wait(30)
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded"
        gate.set()
        t.join(60)
        assert first["r"].status_code == 200
        assert c.post("/v1/chat/completions", json=body).status_code == 200  # the place was given back


def test_targets_load_once(store, target, tiny_dir, monkeypatch):
    from mot_cag.models import registry
    from mot_cag.server import Engine, create_app

    calls = []
    real = registry.load_model
    monkeypatch.setattr(registry, "load_model", lambda name, **kw: calls.append(name) or real(name, **kw))
    other = str(tiny_dir / "tiny-opt")
    cfg = PipelineConfig(source=target, store=str(store), targets=[target], max_new_tokens=3, top_k=2)
    with TestClient(create_app(cfg, engine=Engine(cfg, "cpu"))) as c:
        for model in (target, other, target, other, target):
            body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                    "mot_cag": {"mode": "direct"}}
            assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert sorted(calls) == sorted([target, other])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_server_leaves_the_store_intact(store, target, tmp_path):
    """SIGKILL while a request is being answered: the store still verifies and answers the same."""
    from mot_cag.store.verify import verify_store

    port = _free_port()
    pipe = tmp_path / "p.toml"
    pipe.write_text(PipelineConfig(source=target, store=str(store), targets=[target], max_new_tokens=40,
                                   top_k=2).to_toml())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mot_cag", "serve", "--port", str(port), "--pipeline", str(pipe),
                             "--target", target], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.3)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": target, "stream": True, "messages": [
                                         {"role": "user", "content": QUESTION}]}).encode(),
                                     headers={"content-type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=60)
        assert resp.readline().startswith(b"data: ")  # the request is being answered
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    report = verify_store(store)
    assert report.ok, report.to_dict()
