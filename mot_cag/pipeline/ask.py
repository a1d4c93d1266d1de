"""Answer a question from a store: retrieve -> load -> translate -> assemble -> generate (``mot-cag ask``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mot_cag.errors import MotCagError
from mot_cag.models.registry import LoadedModel, load_model
from mot_cag.names import CONTEXT_MODES, choose
from mot_cag.pipeline.context import ContextBuilder, Piece, Recompute
from mot_cag.pipeline.generate import answer_rule, fits, generate
from mot_cag.pipeline.retrieval import hits_to_pieces, open_store
from mot_cag.pipeline.translation import builder_for
from mot_cag.prompts import encode

#: Positions a question's context and prompt must leave for the answer.
MIN_ANSWER_TOKENS = 8


@dataclass
class AskResult:
    """What ``ask --json`` prints (cli.md)."""

    answer: str
    target: str
    source: str
    mode: str
    chunks: list[dict]
    timings: dict[str, float]
    context_tokens: int
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"answer": self.answer, "target": self.target, "source": self.source, "mode": self.mode,
                "chunks": self.chunks, "timings": self.timings, "context_tokens": self.context_tokens}


class Asker:
    """Answers questions from one store with one target in one mode; keeps models, translators and the
    translated-chunk LRU warm across questions.

    Args:
        store: Store folder, or an open :class:`~mot_cag.store.store.Store` (shared, e.g. by a server).
        target: Target model name, or a loaded model (shared).
        mode: ``translated`` (default), ``direct``, ``native-chunks`` or ``none``.
        device: Torch device.
        translator: Translator folder (default: the one found for the pair).
        max_new_tokens: Generation budget.
        injection: How translated caches enter the target (``auto``, ``inject-all``, ``replay``, ``replay-joint``;
            see :func:`~mot_cag.pipeline.translation.translated_builder`).
        recompute: Cross-chunk repair of joined caches (native-chunks and translated modes; default off).
        replay_window: Replay-joint injection's share of target layers that take translated K/V (``auto``: the
            translator's own).
    """

    def __init__(self, store, target: str | LoadedModel, mode: str = "translated",
                 device: torch.device | str = "cpu", translator: str | None = None, max_new_tokens: int = 48,
                 injection: str = "auto", recompute: Recompute | None = None,
                 replay_window: float | str = "auto"):
        mode = choose("context mode", mode, CONTEXT_MODES)
        self.store = store if hasattr(store, "search") else open_store(store)
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        self.target = target if isinstance(target, LoadedModel) else load_model(target, device=device)
        self.source_name = self.store.source.name
        source = None
        if mode == "translated":
            source = load_model(self.source_name, weights=False)
            if source.fingerprint != self.store.source.fingerprint:
                raise MotCagError(f"Model '{self.source_name}' on this machine differs from the one that made store "
                                  f"{self.store.root}; re-ingest the documents.")
        self.builder: ContextBuilder = builder_for(mode, self.target, recompute, source, translator, injection,
                                                   self.store.config.prefix_ids, replay_window)

    def ask(self, question: str, top_k: int = 4, on_text: Callable[[str], None] | None = None,
            hits: list | None = None, stop: Sequence[str] = (), max_new_tokens: int | None = None) -> AskResult:
        """Answer ``question``; ``on_text`` receives the answer as it grows (streaming).

        Args:
            question: The question.
            top_k: Chunks to retrieve.
            on_text: Streaming callback.
            hits: Already retrieved chunks (:class:`~mot_cag.store.search.Hit`), e.g. from a llama-index
                retriever; skips retrieval.
            stop: Stop sequences: the answer ends before the first one generated (a line break always ends it).
            max_new_tokens: Generation budget of this question (default: the asker's).
        """
        if not question or not question.strip():
            raise MotCagError("The question is empty; ask something, e.g. mot-cag ask \"Where was Ana Brell born?\".")
        t0 = time.perf_counter()
        if hits is None:
            self._check_top_k(top_k)
            hits = self.store.search(question, k=top_k) if self.mode != "none" else []
        t_retrieve = time.perf_counter() - t0
        pieces = hits_to_pieces(self.store, hits, self.target.device)
        t_load = 0.0
        if self.mode == "translated":  # read every chunk now so load time is reported apart from translation
            t1 = time.perf_counter()
            loaded = [(p, p.source_kv()) for p in pieces]
            pieces = [Piece(p.text, p.key, source_kv=lambda c=c: c) for p, c in loaded]
            t_load = time.perf_counter() - t1
        ctx = self.builder.build(pieces)
        prompt = self.builder.prompt
        suffix = encode(self.target.tokenizer, prompt.suffix_text(question))
        if not fits(self.target, ctx.tokens + len(suffix), MIN_ANSWER_TOKENS):
            raise MotCagError(f"The retrieved context ({ctx.tokens} tokens) and question do not fit "
                              f"{self.target.name}'s {self.target.layout.max_positions} positions; lower --top-k.")
        stops = tuple(x for x in stop if x)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget < 1:
            raise MotCagError(f"The generation budget must be at least 1 token, got {budget}.")
        gen = generate(self.target, ctx.kv, suffix, budget, answer_rule(prompt, stops), t0, on_text,
                       hold=max((len(e) - 1 for e in stops), default=0), ban_first=prompt.first_token_bans)
        text = gen.text.strip()
        # Chat boilerplate ("The answer is: ...") is dropped for real models; the zoo's sentence is kept as is.
        answer = text if prompt.kind == "qa" else prompt.extract(text) or text
        total = time.perf_counter() - t0
        # translate_s: translating the chunks; prefill_s: target passes over the context (direct, native
        # chunks, and the replay of replay injection).
        timings = {"retrieve_s": t_retrieve, "load_s": t_load,
                   "translate_s": ctx.timings.get("translate_s", 0.0), "prefill_s": ctx.timings.get("prefill_s", 0.0),
                   "ttft_s": gen.ttft_s, "total_s": total}
        chunks = [{"doc": h.doc, "chunk": h.chunk_index, "score": h.score, "text": h.text} for h in hits]
        return AskResult(answer, self.target.name, self.source_name, self.mode, chunks, timings, ctx.tokens,
                         extra={"prompt_tokens": ctx.tokens + len(suffix), "completion_tokens": gen.tokens,
                                "finish_reason": gen.finish, "hits": hits})

    def _check_top_k(self, top_k: int) -> None:
        if top_k <= 0:
            raise MotCagError(f"--top-k must be at least 1, got {top_k}.")
        n_chunks = self.store.info()["chunks"]
        if top_k > n_chunks:
            raise MotCagError(f"--top-k {top_k} is larger than the store ({n_chunks} chunks); use --top-k "
                              f"{n_chunks} or fewer.")
