"""The prompts a target reads around its context, defined once and shared by ``ask``, ``eval`` and benchmarks.

Every prompt is ``head + pieces + suffix``, tokenized in those three parts so that every context mode
(direct text, translated cache, native chunks, no context) feeds the target the same tokens around the
context and the head's KV can be computed once and kept at the start of an assembled context:

- ``qa`` (the zoo, docs/synthetic-qa.md): head = the tokenizer's BOS ids, pieces joined as they are,
  suffix ``\\nQuestion: {q}\\nAnswer: {cue}``; the answer ends at the first sentence end or newline.
- ``chat`` (real instruct models with a chat template): the template rendered for one user turn holding an
  instruction, the documents and the question, plus the generation prompt. The head is everything before
  the documents (template header, system text, instruction); each piece ends with a blank line; the suffix
  is the question, end of turn and the assistant header. The answer ends at end of turn or a newline.
- ``completion`` (base models without a chat template): BOS, an instruction line, the documents (each ending
  with a blank line), then ``Question: {q}\\nAnswer:``; the answer ends at a newline.

:func:`prompt_format` picks the format of a loaded model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

PromptKind = Literal["qa", "chat", "completion"]

#: The instruction of chat and completion prompts. A terser one tried on the dev corpus ("Reply with only the
#: answer itself (a name, place, number or word), not a full sentence") raised Qwen2.5-Coder's exact match
#: (0.08 -> 0.42 on 12 dev questions) but lowered contains-answer (0.67 -> 0.50) and made it answer the demo
#: question with another person's birthplace; docs/chunk-caches.md.
INSTRUCTION = "Answer the question using the documents below. Reply with the answer only, in a few words."
PIECE_SEPARATOR = "\n\n"
_DOCS = "\u2063DOCUMENTS\u2063"  # a sentinel no template contains
_QUESTION = "\u2063QUESTION\u2063"


def qa_suffix(question: str, cue: str | None = None) -> str:
    """``\\nQuestion: {question}\\nAnswer:`` followed by `` {cue}`` when a cue is given."""
    text = f"\nQuestion: {question.strip()}\nAnswer:"
    return f"{text} {cue.strip()}" if cue else text


REPEAT_SUFFIX = "\nRepeat:"


def answer_continuation(answer: str) -> str:
    """The reference continuation after the cue: `` {answer}.``."""
    return f" {answer.strip()}."


def repeat_continuation(document: str) -> str:
    """The reference continuation of the repeat task: `` {document}``."""
    return f" {document}"


_END = re.compile(r"\.(\s|$)|\n")


def extract_prediction(generated: str) -> str:
    """The answer in a continuation: text up to the first ``.`` followed by a space or end, or newline."""
    m = _END.search(generated)
    return (generated[: m.start()] if m else generated).strip()


def answer_finished(generated: str) -> bool:
    """True once a continuation holds a complete answer (decoding can stop)."""
    return bool(re.search(r"\.(\s)|\n", generated)) or generated.rstrip().endswith(".")


# ------------------------------------------------------------------------------------------- tokenization


# --------------------------------------------------------------------------------------------- formats

_SENTENCE_END = re.compile(r"\.\s|\n")

#: Phrases chatty models put before the answer ("The answer is: Corvale").
_BOILERPLATE = re.compile(
    r"^\s*(?:(?:the\s+)?(?:short\s+|final\s+)?answer(?:\s+to\s+(?:this|the|your)\s+question)?(?:\s+is)?\s*[:\-]?"
    r"|a\s*:)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class PromptFormat:
    """How one target model is prompted with a context and a question.

    Attributes:
        kind: ``qa``, ``chat`` or ``completion`` (module docstring).
        head: Token ids before the context (BOS, chat header, instruction): computed once per target.
        separator: Text appended to every context piece (empty for ``qa``).
        template: For ``chat``, the rendered text after the documents with ``_QUESTION`` in place of the
            question (end of user turn and assistant header included).
        first_token_bans: Token ids an answer may not start with (real models: a line break or the end of
            text). A base model reading joined chunk caches sometimes writes a line break first and then loops
            on ``Answer:``, an empty answer; the question was asked, so the answer starts with content.
    """

    kind: PromptKind
    head: tuple[int, ...]
    separator: str = ""
    template: str = ""
    first_token_bans: tuple[int, ...] = ()

    def piece_text(self, text: str) -> str:
        """A context piece's text as the target reads it."""
        return text + self.separator

    def suffix_text(self, question: str, cue: str | None = None) -> str:
        """The text after the context. ``cue`` (the synthetic-QA answer start) is used by ``qa`` only: real
        models answer in their own words."""
        if self.kind == "qa":
            return qa_suffix(question, cue)
        if self.kind == "chat":
            return self.template.replace(_QUESTION, question.strip())
        return f"Question: {question.strip()}\nAnswer:"

    def reference(self, answer: str) -> str:
        """The reference continuation scored by NLL/KL: `` {answer}.`` (``qa``, ``completion``) or
        ``{answer}`` then end of line (``chat``, whose reply starts without a space)."""
        if self.kind == "chat":
            return f"{answer.strip()}"
        return answer_continuation(answer)

    def finished(self, generated: str) -> bool:
        """True once a continuation holds a complete answer (decoding can stop)."""
        if self.kind == "qa":
            return answer_finished(generated)
        # Real models: one sentence or one line answers a short question; stopping there keeps a chatty
        # model from going on to restate the other documents.
        return bool(generated.strip()) and bool(_SENTENCE_END.search(generated.lstrip()))

    def extract(self, generated: str) -> str:
        """The answer in a continuation: ``qa`` as the spec says; otherwise the first sentence of the first
        non-empty line, with chat boilerplate (``The answer is:``) and a final period removed."""
        if self.kind == "qa":
            return extract_prediction(generated)
        line = next((ln for ln in generated.split("\n") if ln.strip()), "")
        line = _BOILERPLATE.sub("", line.strip(), count=1).strip()
        return extract_prediction(line)


def qa_format(tokenizer) -> PromptFormat:
    """The synthetic-QA format (zoo models)."""
    return PromptFormat("qa", tuple(bos_ids(tokenizer)))


def chat_format(tokenizer) -> PromptFormat:
    """The chat format from the tokenizer's chat template (one user turn, generation prompt).

    Raises:
        ValueError: The tokenizer has no chat template, or it does not keep the user text verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template")
    content = f"{INSTRUCTION}\n\n{_DOCS}Question: {_QUESTION}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_DOCS) != 1 or text.count(_QUESTION) != 1:
        raise ValueError("the chat template does not keep the user message verbatim")
    before, after = text.split(_DOCS)
    # The rendered text spells out any BOS itself; encoding it without special tokens keeps it once.
    return PromptFormat("chat", tuple(encode(tokenizer, before)), PIECE_SEPARATOR, after, blank_starts(tokenizer))


def completion_format(tokenizer) -> PromptFormat:
    """The plain completion format for base models."""
    head = bos_ids(tokenizer) + encode(tokenizer, f"{INSTRUCTION}\n\n")
    return PromptFormat("completion", tuple(head), PIECE_SEPARATOR, first_token_bans=blank_starts(tokenizer))


def blank_starts(tokenizer) -> tuple[int, ...]:
    """The end-of-text id and the ids that spell only line breaks (``\\n``, ``\\n\\n``, ...): what an answer
    may not start with."""
    ids = {t for t in (tokenizer.eos_token_id,) if isinstance(t, int)}
    for text in ("\n", "\n\n", "\n\n\n", " \n", " \n\n"):
        enc = encode(tokenizer, text)
        if len(enc) == 1:
            ids.add(enc[0])
    return tuple(sorted(ids))


def prompt_format(lm, kind: PromptKind | Literal["auto"] = "auto") -> PromptFormat:
    """The prompt format of a loaded model: ``qa`` for the zoo (and local tiny models without a chat
    template that were trained on the synthetic format: origin ``zoo`` or ``local``), ``chat`` when the
    tokenizer has a chat template, ``completion`` otherwise (a packaged or HF base model).

    Args:
        lm: A :class:`~mot_cag.models.registry.LoadedModel`.
        kind: Force a format instead of choosing.
    """
    tok = lm.tokenizer
    if kind == "auto":
        origin = getattr(getattr(lm, "ref", None), "origin", "zoo")
        if getattr(tok, "chat_template", None):
            kind = "chat"
        elif origin in ("package", "hf-cache"):
            kind = "completion"
        else:
            kind = "qa"
    if kind == "qa":
        return qa_format(tok)
    if kind == "chat":
        return chat_format(tok)
    if kind == "completion":
        return completion_format(tok)
    raise ValueError(f"Unknown prompt format '{kind}'; choose auto, qa, chat or completion.")


def prefixes_chunks(fmt: PromptFormat, positions: str) -> bool:
    """Whether chunks read in ``fmt`` are prefilled after its head by default (``chunk_prefix = "auto"``): for
    RoPE models (a prefilled chunk can be moved) prompted with a chat or completion template that has a head. The
    zoo's synthetic-QA format and absolute-position models prefill each chunk alone."""
    return positions == "rope" and fmt.kind != "qa" and bool(fmt.head)


def bos_ids(tokenizer) -> list[int]:
    """Ids the tokenizer puts before every text (OPT: ``</s>``; GPT-2, Qwen2: none)."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def as_tensor(ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[seq]`` long tensor."""
    return torch.tensor(ids, dtype=torch.long, device=device)
