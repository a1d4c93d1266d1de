"""Prompt format of shared/spec/synthetic-qa.md, shared by ``ask`` and ``eval``.

The context (document text or a KV cache of it) comes first; the text after it always starts at
``\\nQuestion:`` (or ``\\nRepeat:``). Context and suffix are tokenized separately so that every mode
(direct text, translated cache, native chunks, no context) feeds the target the same suffix tokens.
"""

from __future__ import annotations

import re

import torch


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


def bos_ids(tokenizer) -> list[int]:
    """Ids the tokenizer puts before every text (OPT: ``</s>``; GPT-2, Qwen2: none)."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def as_tensor(ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[seq]`` long tensor."""
    return torch.tensor(ids, dtype=torch.long, device=device)
