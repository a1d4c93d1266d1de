"""The one answer loop: greedy decoding after an assembled context, with time to first token, a token budget,
a stop rule and streaming. ``ask``, the server and ``eval`` all generate through :func:`generate`; they differ
only in the stop rule they pass.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mot_cag.models import cache as kv
from mot_cag.models.registry import LoadedModel
from mot_cag.prompts import PromptFormat, as_tensor

#: Decoded text -> (the part that is the answer so far, whether it is complete).
StopRule = Callable[[str], tuple[str, bool]]

_SENTENCE_END = re.compile(r"\.(?=\s)")


@dataclass
class Generation:
    """What one decode produced.

    Attributes:
        text: The decoded text as the stop rule keeps it.
        tokens: Generated token count.
        ttft_s: Seconds from ``t0`` to the first generated token.
        finish: ``stop`` (the rule, the end-of-sequence token or the position limit ended it) or ``length`` (the
            budget ran out first; OpenAI's terms).
    """

    text: str
    tokens: int
    ttft_s: float
    finish: str


def answer_rule(prompt: PromptFormat, stops: Sequence[str] = ()) -> StopRule:
    """``ask``'s rule: the answer ends before the first stop sequence or line break (leading line breaks
    skipped), and after its first sentence, or when the prompt format says it is complete."""
    ends = ("\n",) + tuple(s for s in stops if s)

    def rule(decoded: str) -> tuple[str, bool]:
        text = decoded.lstrip("\n")
        cut = min((i for i in (text.find(e) for e in ends) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        m = _SENTENCE_END.search(text)
        if m:
            return text[:m.end()], True
        return text, cut >= 0 or prompt.finished(text)

    return rule


def continuation_rule(prompt: PromptFormat) -> StopRule:
    """``eval``'s rule: decode until the prompt format says the continuation holds an answer, keep it whole (the
    scorer extracts the answer, as the synthetic-QA contract says)."""
    return lambda decoded: (decoded, prompt.finished(decoded))


def generate(target: LoadedModel, context: kv.KVChunk | None, suffix_ids: list[int], budget: int, rule: StopRule,
             t0: float | None = None, on_text: Callable[[str], None] | None = None, hold: int = 0,
             ban_first: Sequence[int] = ()) -> Generation:
    """Greedily answer after ``context`` + ``suffix_ids``.

    The context is copied once into the decoding cache (:func:`~mot_cag.models.cache.greedy_tokens`); nothing
    else is copied per question.

    Args:
        target: The answering model.
        context: The assembled context cache, or ``None``.
        suffix_ids: Token ids after the context (the question part of the prompt).
        budget: At most this many new tokens.
        rule: When the answer is complete, and what of the decoded text it is (:func:`answer_rule`).
        t0: Start of the request for TTFT (default: now).
        on_text: Receives the answer text as it grows (streaming); a text never shrinks once sent.
        hold: Characters held back from streaming until the answer is complete (the longest stop sequence
            minus one, so a stop sequence being generated is never streamed).
        ban_first: Token ids the answer may not start with (the prompt format's ``first_token_bans``).
    """
    t0 = time.perf_counter() if t0 is None else t0
    tok = target.tokenizer
    eos = tok.eos_token_id if isinstance(tok.eos_token_id, int) else None
    ids: list[int] = []
    ttft = None
    shown = ""

    def complete(generated: list[int]) -> bool:
        return rule(tok.decode(generated, skip_special_tokens=True))[1]

    for t in kv.greedy_tokens(target.model, as_tensor(suffix_ids, target.device), context, budget, stop=complete,
                              eos_token_id=eos, ban_first=ban_first):
        if ttft is None:
            ttft = time.perf_counter() - t0
        ids.append(t)
        if on_text is None:
            continue
        text, ended = rule(tok.decode(ids, skip_special_tokens=True))
        if not ended and hold:
            text = text[:len(text) - hold]
        text = text.rstrip("\ufffd")  # a character whose bytes span tokens is streamed once complete
        if len(text) > len(shown) and text.startswith(shown):
            on_text(text[len(shown):])
            shown = text
    text, ended = rule(tok.decode(ids, skip_special_tokens=True))
    finish = "stop" if ended or len(ids) < budget or (ids and ids[-1] == eos) else "length"
    return Generation(text, len(ids), ttft if ttft is not None else time.perf_counter() - t0, finish)


def fits(target: LoadedModel, tokens: int, reserve: int) -> bool:
    """Whether ``tokens`` positions of context and prompt leave ``reserve`` positions of the target's range."""
    return tokens + reserve <= target.layout.max_positions
