"""``mot-cag serve``: one long-running process that keeps stores, embedder, models and translators warm, so
several agents (of different model families) share one store without reloading anything per question.

Endpoints (OpenAI-compatible where a counterpart exists; the ``model`` field names the target):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: the last user message (or the prompt) is the
  question; retrieval options go in the extension field ``mot_cag`` (``store``, ``top_k``, ``mode``,
  ``injection``, ``recompute``, ``replay_window``); ``stream: true`` answers with server-sent events;
  ``stop`` and ``max_tokens`` as in OpenAI's API. The response carries the cited chunks and timings in its
  own ``mot_cag`` field.
* ``POST /v1/retrieve``: the chunks a question retrieves, without generating.
* ``GET /v1/models``: the targets this machine can serve. ``GET /health``: liveness and what is loaded.

Concurrency: requests are admitted up to ``max_pending`` at a time (a request beyond that gets a 503 JSON
error at once, never a hang); generation runs in worker threads, at most ``parallel`` at a time (on a CPU
more parallel generations only share the same cores). Retrieval does not wait for generation. The server
only reads stores, so killing it at any moment leaves every store as it was.
"""


import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mot_cag.config import PipelineConfig
from mot_cag.errors import MotCagError
from mot_cag.names import CONTEXT_MODES, INJECTIONS, choose

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _fastapi():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MotCagError("mot-cag serve needs FastAPI and uvicorn: pip install 'mot-cag[server]'.") from None


@dataclass(frozen=True)
class AskOptions:
    """What selects one warm :class:`~mot_cag.pipeline.ask.Asker` (the per-request retrieval options)."""

    store: str
    target: str
    mode: str
    injection: str
    recompute: float | str
    replay_window: float | str


class Engine:
    """Warm state shared by all requests: open stores, loaded models, one asker per option set.

    Thread-safe: lookups happen under a lock, each asker answers one question at a time (its translated-chunk
    cache is not shared between threads), and at most ``parallel`` answers are generated at once.
    """

    def __init__(self, cfg: PipelineConfig, device, parallel: int = 1):
        self.cfg = cfg
        self.device = device
        self._lock = threading.Lock()
        self._stores: dict[str, Any] = {}
        self._models: dict[str, Any] = {}
        self._askers: dict[AskOptions, tuple[Any, threading.Lock]] = {}
        self._generate = threading.Semaphore(max(1, parallel))

    def options(self, target: str | None, ext: dict) -> AskOptions:
        """The asker options of a request: its extension field over the pipeline's defaults."""
        cfg = self.cfg.override(store=ext.get("store"), mode=ext.get("mode"), injection=ext.get("injection"),
                                recompute=ext.get("recompute"), replay_window=ext.get("replay_window"))
        return AskOptions(str(cfg.store), target or cfg.targets[0], cfg.mode, cfg.injection, cfg.recompute,
                          cfg.replay_window)

    def store(self, path: str):
        """The open store at ``path`` (opened once, then shared by every request)."""
        from mot_cag.pipeline.retrieval import open_store

        key = str(Path(path).resolve())
        with self._lock:
            st = self._stores.get(key)
            if st is None:
                st = self._stores[key] = open_store(path)
            return st

    def model(self, name: str):
        """The loaded target ``name`` (loaded once per process)."""
        from mot_cag.models.registry import load_model

        with self._lock:
            m = self._models.get(name)
        if m is None:
            m = load_model(name, device=self.device)  # slow: outside the lock, so other targets keep serving
            with self._lock:
                m = self._models.setdefault(name, m)
        return m

    def asker(self, opts: AskOptions):
        """The warm asker of ``opts`` and the lock that serialises its questions."""
        from mot_cag.pipeline.ask import Asker
        from mot_cag.pipeline.context import Recompute

        with self._lock:
            got = self._askers.get(opts)
        if got is not None:
            return got
        store = self.store(opts.store)
        target = self.model(opts.target)
        asker = Asker(store, target, mode=opts.mode, device=self.device, max_new_tokens=self.cfg.max_new_tokens,
                      injection=opts.injection, recompute=Recompute.parse(opts.recompute, self.cfg.recompute_policy),
                      replay_window=opts.replay_window)
        with self._lock:
            return self._askers.setdefault(opts, (asker, threading.Lock()))

    def answer(self, opts: AskOptions, question: str, top_k: int, stop: list[str], max_tokens: int | None,
               on_text=None):
        """Answer one question (blocking; call from a worker thread)."""
        asker, lock = self.asker(opts)
        with self._generate, lock:
            return asker.ask(question, top_k=top_k, on_text=on_text, stop=stop, max_new_tokens=max_tokens)

    def loaded(self) -> dict:
        with self._lock:
            return {"stores": sorted(self._stores), "models": sorted(self._models),
                    "askers": [o.__dict__ for o in self._askers]}

    def close(self) -> None:
        with self._lock:
            for st in self._stores.values():
                st.close()
            self._stores.clear()


# ------------------------------------------------------------------------------------------------ requests


def _question(body: dict, chat: bool) -> str:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise MotCagError("'messages' must be a non-empty list of {role, content} objects.")
        users = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise MotCagError("'messages' holds no message with role 'user'.")
        content = users[-1].get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise MotCagError("The last user message has no text content.")
        return content
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise MotCagError("'prompt' must be a string.")
    return prompt


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return stop
    raise MotCagError("'stop' must be a string or a list of at most 4 strings.")


def _int(body: dict, key: str, default: int | None, lo: int = 1, hi: int = 4096) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MotCagError(f"'{key}' must be an integer from {lo} to {hi}.")
    return v


def _ext(body: dict) -> dict:
    ext = body.get("mot_cag") or {}
    if not isinstance(ext, dict):
        raise MotCagError("'mot_cag' must be an object (store, top_k, mode, injection, recompute, replay_window).")
    unknown = set(ext) - {"store", "top_k", "mode", "injection", "recompute", "replay_window"}
    if unknown:
        raise MotCagError(f"Unknown mot_cag option(s): {', '.join(sorted(unknown))}.")
    if "mode" in ext:
        ext["mode"] = choose("mot_cag.mode", ext["mode"], CONTEXT_MODES)
    if "injection" in ext:
        ext["injection"] = choose("mot_cag.injection", ext["injection"], INJECTIONS)
    return ext


class Admission:
    """At most ``limit`` requests in progress; the next one is told to come back (503)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pending = 0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        """Take a place; False when all are taken."""
        with self._lock:
            if self.pending >= self.limit:
                return False
            self.pending += 1
            return True

    def release(self) -> None:
        """Give a place back."""
        with self._lock:
            self.pending -= 1


def _error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _install_error_handlers(app) -> None:
    """Every error becomes one JSON object with a status: 400 for user errors, 4xx from the framework, 500
    (named) for bugs; never a traceback."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(MotCagError)
    async def _user_error(request: Request, e: MotCagError):  # noqa: ARG001
        return _error(400, str(e), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):  # noqa: ARG001
        return _error(422, "The request body is not valid JSON of the expected shape.", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):  # noqa: ARG001
        return _error(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # noqa: ARG001
        return _error(500, f"Internal error: {type(e).__name__}: {e}", "server_error")


async def _body_of(request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MotCagError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise MotCagError("The request body must be a JSON object.")
    return body


def create_app(cfg: PipelineConfig, device="cpu", parallel: int = 1, max_pending: int = 32, engine=None):
    """The ASGI app (FastAPI). ``engine`` may be given to share warm state (tests)."""
    _fastapi()
    from fastapi import FastAPI, Request

    from mot_cag import __version__

    eng = engine or Engine(cfg, device, parallel)
    app = FastAPI(title="mot-cag", version=__version__)
    app.state.engine = eng
    places = Admission(max_pending)
    _install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": __version__, "pending": places.pending, **eng.loaded()}

    @app.get("/v1/models")
    async def list_models():
        from mot_cag.models.registry import list_models

        rows = await asyncio.to_thread(list_models)
        names = [r["name"] for r in rows if r["family"] is not None or r["origin"] == "package"]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "mot-cag"} for n in names]}

    @app.post("/v1/retrieve")
    async def retrieve(request: Request):
        return await _retrieve(eng, cfg, await _body_of(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(eng, cfg, places, await _body_of(request), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(eng, cfg, places, await _body_of(request), chat=False)

    return app


async def _retrieve(eng: Engine, cfg: PipelineConfig, body: dict) -> dict:
    query = body.get("query") or body.get("question")
    if not isinstance(query, str) or not query.strip():
        raise MotCagError("'query' must be a non-empty string.")
    ext = _ext({"mot_cag": {k: body[k] for k in ("store",) if k in body}})
    top_k = _int(body, "top_k", cfg.top_k, 1, 1000)
    opts = eng.options(None, ext)
    hits = await asyncio.to_thread(lambda: eng.store(opts.store).search(query, k=top_k))
    return {"object": "list", "store": opts.store,
            "data": [{"doc": h.doc, "chunk": h.chunk_index, "score": h.score, "text": h.text, "key": h.key,
                      "char_start": h.char_start, "char_end": h.char_end} for h in hits]}


async def _complete(eng: Engine, cfg: PipelineConfig, places: Admission, body: dict, chat: bool):
    from fastapi.responses import JSONResponse, StreamingResponse

    question = _question(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise MotCagError("'model' must be a string (the target model).")
    ext = _ext(body)
    opts = eng.options(model, ext)
    top_k = _int(ext, "top_k", cfg.top_k, 1, 1000)
    stop = _stops(body)
    max_tokens = _int(body, "max_tokens", None)
    if not places.admit():
        return _error(503, f"The server is busy ({places.limit} requests in progress); retry shortly.", "overloaded")
    if body.get("stream", False):  # the stream gives its place back when it ends
        return StreamingResponse(_stream(eng, opts, question, top_k, stop, max_tokens, chat, places.release),
                                 media_type="text/event-stream")
    try:
        res = await asyncio.to_thread(eng.answer, opts, question, top_k, stop, max_tokens)
    finally:
        places.release()
    return JSONResponse(_response(res, opts, chat))


def _response(res, opts: AskOptions, chat: bool) -> dict:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    finish = res.extra.get("finish_reason", "stop")
    choice = ({"index": 0, "message": {"role": "assistant", "content": res.answer}, "finish_reason": finish}
              if chat else {"index": 0, "text": res.answer, "finish_reason": finish, "logprobs": None})
    usage = {"prompt_tokens": res.extra.get("prompt_tokens", 0),
             "completion_tokens": res.extra.get("completion_tokens", 0)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": res.target, "choices": [choice], "usage": usage,
            "mot_cag": {"source": res.source, "mode": res.mode, "store": opts.store, "chunks": res.chunks,
                        "timings": res.timings, "context_tokens": res.context_tokens}}


async def _stream(eng: Engine, opts: AskOptions, question: str, top_k: int, stop: list[str],
                  max_tokens: int | None, chat: bool, release) -> AsyncIterator[str]:
    """Server-sent events: one event per piece of answer text, a last one with the finish reason and the
    mot_cag field, then ``[DONE]``. An error after the stream began arrives as an ``error`` event."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(delta: str | None, finish: str | None = None, extra: dict | None = None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant"} if role else ({"content": delta} if delta is not None else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        data = {"id": rid, "object": obj, "created": created, "model": opts.target, "choices": [choice]}
        if extra:
            data.update(extra)
        return f"data: {json.dumps(data)}\n\n"

    def run():
        try:
            res = eng.answer(opts, question, top_k, stop, max_tokens,
                             on_text=lambda t: loop.call_soon_threadsafe(queue.put_nowait, ("text", t)))
            loop.call_soon_threadsafe(queue.put_nowait, ("done", res))
        except BaseException as e:  # noqa: BLE001 - reported to the client as an event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

    worker = loop.run_in_executor(None, run)
    try:
        if chat:
            yield event(None, role=True)
        while True:
            kind, item = await queue.get()
            if kind == "text":
                yield event(item)
            elif kind == "done":
                body = _response(item, opts, chat)
                tail = {"mot_cag": {**body["mot_cag"], "answer": item.answer}, "usage": body["usage"]}
                yield event(None, item.extra.get("finish_reason", "stop"), tail)
                yield "data: [DONE]\n\n"
                break
            else:
                msg = str(item) if isinstance(item, MotCagError) else f"Internal error: {type(item).__name__}: {item}"
                yield f"data: {json.dumps({'error': {'message': msg, 'type': 'server_error'}})}\n\n"
                break
    finally:
        await worker
        release()


def serve(cfg: PipelineConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, device="cpu",
          parallel: int = 1, max_pending: int = 32, preload: list[str] | None = None,
          log_level: str = "warning") -> None:
    """Run the server until interrupted (blocking)."""
    _fastapi()
    import uvicorn

    app = create_app(cfg, device=device, parallel=parallel, max_pending=max_pending)
    eng: Engine = app.state.engine
    for target in preload or []:  # warm before accepting requests, so the first question is not slow
        eng.asker(eng.options(target, {}))
    uvicorn.run(app, host=host, port=port, log_level=log_level)
