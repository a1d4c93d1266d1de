"""Training and calibration examples for translators: ``(context, continuation)`` text pairs.

The context is what gets cached (prefilled by the source, translated); the continuation is read by the target
over the translated cache (prompt-LM loss) and starts at ``\\nQuestion:`` or ``\\nRepeat:`` as in
shared/spec/synthetic-qa.md. Sources: the synthetic generator (``synthetic``, training split of invented
strings), a JSONL file of cli.md rows (``context`` + ``question``/``cue``/``answer``), or a plain text file
(each paragraph split in two, for real models on real corpora).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from mot_cag.errors import MotCagError

Pair = tuple[str, str]


def split_training_text(text: str) -> Pair:
    """Split a synthetic training sequence at its first ``\\nQuestion:`` / ``\\nRepeat:`` marker."""
    cut = min((i for i in (text.find("\nQuestion:"), text.find("\nRepeat:")) if i >= 0), default=-1)
    if cut < 0:
        half = len(text) // 2
        cut = text.rfind(" ", 0, half) if text.rfind(" ", 0, half) > 0 else half
    return text[:cut], text[cut:]


def synthetic_pairs(seed: int, repeat_prob: float = 0.3, n_entities: tuple[int, int] = (2, 5),
                    facts_per_entity: tuple[int, int] = (1, 3), split: str = "train") -> Iterator[Pair]:
    """Endless synthetic pairs: fact QA (documents + Q/A lines) and the repeat task, mixed."""
    from mot_cag.data.synthetic import qa_training_text, repeat_training_text

    rng = random.Random(seed)
    while True:
        ents = rng.randint(*n_entities)
        facts = rng.randint(*facts_per_entity)
        if rng.random() < repeat_prob:
            text = repeat_training_text(rng, ents, facts, split=split)
        else:
            text = qa_training_text(rng, ents, facts, n_questions=rng.randint(1, 3), split=split)
        yield split_training_text(text)


def _jsonl_pairs(path: Path) -> list[Pair]:
    pairs = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        ctx = row.get("context", "")
        if row.get("task") == "repeat":
            pairs.append((ctx, f"\nRepeat: {ctx}"))
        elif row.get("question") is not None:
            answer = row.get("answer", "")
            cue = row.get("cue")
            tail = f"{cue} {answer}." if cue else f"{answer}"
            pairs.append((ctx, f"\nQuestion: {row['question']}\nAnswer: {tail}"))
        elif ctx:
            pairs.append(split_training_text(ctx))
    return pairs


def file_pairs(path: str | Path) -> list[Pair]:
    """Pairs from a JSONL dataset (cli.md rows) or a text file (paragraphs split in two)."""
    p = Path(path)
    if not p.is_file():
        raise MotCagError(f"Training data '{path}' is not a file; pass a JSONL dataset, a text file, or 'synthetic'.")
    if p.suffix == ".jsonl":
        pairs = _jsonl_pairs(p)
    else:
        paras = [x.strip() for x in p.read_text().split("\n\n") if len(x.strip()) > 40]
        pairs = [split_training_text(x) for x in paras]
    if not pairs:
        raise MotCagError(f"No usable examples in '{path}'.")
    return pairs


def pair_stream(data: str, seed: int, repeat_prob: float = 0.3) -> Iterator[Pair]:
    """Endless pairs from ``data`` (``synthetic`` or a file path), shuffled with ``seed``."""
    if data in ("synthetic", "synthetic:qa", ""):
        yield from synthetic_pairs(seed, repeat_prob)
        return
    pairs = file_pairs(data)
    rng = random.Random(seed)
    while True:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for i in order:
            yield pairs[i]
