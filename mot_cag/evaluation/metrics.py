"""Scores of docs/synthetic-qa.md: SQuAD-normalised exact match and token F1, and KL/NLL helpers."""

from __future__ import annotations

import re
import string
from collections import Counter

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, squeeze whitespace (SQuAD)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised strings are equal."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def contains_answer(prediction: str, reference: str) -> float:
    """1.0 when the normalised reference occurs in the normalised prediction as whole words (a chatty
    "Ana Brell was born in Corvale" contains "Corvale")."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not ref:
        return float(not pred)
    return float(f" {ref} " in f" {pred} ")


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of the normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row of ``[n, vocab]`` log-probabilities (nats)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)
