"""Answer a question from a store: retrieve -> load -> translate -> assemble -> generate (``mot-cag ask``)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mot_cag.errors import MotCagError
from mot_cag.models import cache as kv
from mot_cag.models.registry import LoadedModel, load_model
from mot_cag.pipeline.context import MODES, ContextBuilder, Piece, Recompute, make_builder
from mot_cag.pipeline.retrieval import hits_to_pieces, open_store
from mot_cag.prompts import as_tensor, encode

_SENTENCE_END = re.compile(r"\.(?=\s)")


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
        injection: How translated caches enter the target (``auto``, ``direct``, ``replay``, ``replay-joint``;
            see :func:`~mot_cag.pipeline.translation.translated_builder`).
        recompute: Cross-chunk repair of joined caches (native-chunks and translated modes; default off).
        replay_window: Replay-joint injection's share of target layers that take translated K/V (``auto``: the
            translator's own).
    """

    def __init__(self, store, target: str | LoadedModel, mode: str = "translated",
                 device: torch.device | str = "cpu", translator: str | None = None, max_new_tokens: int = 48,
                 injection: str = "auto", recompute: Recompute | None = None,
                 replay_window: float | str = "auto"):
        if mode not in MODES:
            raise MotCagError(f"Unknown mode '{mode}'; choose one of {', '.join(MODES)}.")
        self.store = store if hasattr(store, "search") else open_store(store)
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        self.target = target if isinstance(target, LoadedModel) else load_model(target, device=device)
        self.source_name = self.store.source.name
        if mode == "translated":
            from mot_cag.pipeline.translation import translated_builder, window_share

            source = load_model(self.source_name, weights=False)
            if source.fingerprint != self.store.source.fingerprint:
                raise MotCagError(f"Model '{self.source_name}' on this machine differs from the one that made store "
                                  f"{self.store.root}; re-ingest the documents.")
            self.builder: ContextBuilder = translated_builder(source, self.target, translator, injection,
                                                              recompute=recompute,
                                                              chunk_prefix=self.store.config.prefix_ids,
                                                              window=window_share(replay_window))
        else:
            self.builder = make_builder(mode, self.target, recompute=recompute)

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
        suffix = encode(self.target.tokenizer, self.builder.prompt.suffix_text(question))
        if ctx.tokens + len(suffix) + 8 > self.target.layout.max_positions:
            raise MotCagError(f"The retrieved context ({ctx.tokens} tokens) and question do not fit "
                              f"{self.target.name}'s {self.target.layout.max_positions} positions; lower --top-k.")
        stops = tuple(x for x in stop if x)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget < 1:
            raise MotCagError(f"The generation budget must be at least 1 token, got {budget}.")
        answer, ttft, n_new, finish = self._generate(ctx.kv, suffix, t0, on_text, stops, budget)
        total = time.perf_counter() - t0
        # translate_s: translating the chunks; prefill_s: target passes over the context (direct, native
        # chunks, and the replay of replay injection).
        timings = {"retrieve_s": t_retrieve, "load_s": t_load,
                   "translate_s": ctx.timings.get("translate_s", 0.0), "prefill_s": ctx.timings.get("prefill_s", 0.0),
                   "ttft_s": ttft, "total_s": total}
        chunks = [{"doc": h.doc, "chunk": h.chunk_index, "score": h.score, "text": h.text} for h in hits]
        return AskResult(answer, self.target.name, self.source_name, self.mode, chunks, timings, ctx.tokens,
                         extra={"prompt_tokens": ctx.tokens + len(suffix), "completion_tokens": n_new,
                                "finish_reason": finish, "hits": hits})

    def _check_top_k(self, top_k: int) -> None:
        if top_k <= 0:
            raise MotCagError(f"--top-k must be at least 1, got {top_k}.")
        n_chunks = self.store.info()["chunks"]
        if top_k > n_chunks:
            raise MotCagError(f"--top-k {top_k} is larger than the store ({n_chunks} chunks); use --top-k "
                              f"{n_chunks} or fewer.")

    def _generate(self, context: kv.KVChunk | None, suffix: list[int], t0: float,
                  on_text: Callable[[str], None] | None, stops: tuple[str, ...] = (),
                  budget: int = 48) -> tuple[str, float, int, str]:
        tok = self.target.tokenizer
        prompt = self.builder.prompt
        eos = tok.eos_token_id if isinstance(tok.eos_token_id, int) else None
        ends = ("\n",) + stops
        ids: list[int] = []
        ttft = None
        shown = ""

        def text_of(generated: list[int]) -> tuple[str, bool]:
            """The answer so far and whether it is complete: cut before the first stop sequence or line
            break, and after its first sentence (the answer to a short question; eval stops there too)."""
            text = tok.decode(generated, skip_special_tokens=True).lstrip("\n")
            cut = min((i for i in (text.find(e) for e in ends) if i >= 0), default=-1)
            ended = cut >= 0
            if ended:
                text = text[:cut]
            m = _SENTENCE_END.search(text)
            if m:
                return text[:m.end()], True
            return text, ended or prompt.finished(text)

        def stop(generated: list[int]) -> bool:
            return text_of(generated)[1]

        for t in kv.greedy_tokens(self.target.model, as_tensor(suffix, self.target.device), context,
                                  budget, stop=stop, eos_token_id=eos):
            if ttft is None:
                ttft = time.perf_counter() - t0
            ids.append(t)
            text, ended = text_of(ids)
            if not ended and stops:
                # Hold back a tail that could be the start of a stop sequence, so nothing streamed is cut later.
                hold = max((len(e) - 1 for e in stops), default=0)
                text = text[:len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # a character whose bytes span tokens is streamed once complete
            if on_text is not None and len(text) > len(shown) and text.startswith(shown):
                on_text(text[len(shown):])
                shown = text
        text, ended = text_of(ids)
        text = text.strip()
        # "length" when the budget ran out before a stop sequence or the end-of-sequence token (OpenAI's term).
        finish = "stop" if ended or len(ids) < budget or (ids and ids[-1] == eos) else "length"
        # Chat boilerplate ("The answer is: ...") is dropped for real models; the zoo's sentence is kept as is.
        answer = text if prompt.kind == "qa" else prompt.extract(text) or text
        return answer, ttft if ttft is not None else time.perf_counter() - t0, len(ids), finish
