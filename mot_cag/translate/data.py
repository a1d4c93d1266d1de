"""Training and calibration examples for translators: ``(context, continuation)`` text pairs.

The context is what gets cached (prefilled by the source, translated); the continuation is read by the target
over the translated cache (prompt-LM loss) and starts at ``\\nQuestion:`` or ``\\nRepeat:`` as in
docs/synthetic-qa.md. Sources: the synthetic generator (``synthetic``, training split of invented
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


def prose_files() -> list[Path]:
    """Documentation and licence texts shipped inside the installed packages (sorted: deterministic)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    names = ("README", "LICENSE", "LICENCE", "NOTICE", "AUTHORS", "CHANGELOG", "HISTORY")
    out = []
    for path in sorted(root.rglob("*")):
        stem = path.name.upper()
        if not path.is_file() or path.stat().st_size < 400 or path.stat().st_size > 400_000:
            continue
        if path.suffix.lower() in (".md", ".rst", ".txt") or stem.startswith(names):
            if path.suffix.lower() in ("", ".md", ".rst", ".txt"):
                out.append(path)
    return out


def _split_of_path(path: Path) -> str:
    import hashlib

    key = "/".join(path.parts[-3:]).encode()
    return "eval" if hashlib.sha256(key).digest()[0] < 26 else "train"


def prose_pairs(seed: int, split: str = "train", chars: int = 1400) -> Iterator[Pair]:
    """Endless pairs cut from :func:`prose_files` (about ``chars`` characters of context, then a continuation);
    a stable hash of each file's name puts about 10% of the files in the ``eval`` split."""
    rng = random.Random(f"prose:{seed}")
    files = [f for f in prose_files() if _split_of_path(f) == split]
    if not files:
        raise MotCagError("No documentation or licence texts found in the installed packages for training text.")
    while True:
        path = rng.choice(files)
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = "\n".join(line.rstrip() for line in text.splitlines()).strip()
        if len(text) < 400:
            continue
        at = rng.randrange(0, max(1, len(text) - chars - 300))
        at = text.find("\n", at) + 1 if text.find("\n", at) >= 0 else at
        piece = text[at: at + chars + 300]
        cut = piece.rfind(" ", 0, chars)
        if cut < 200 or sum(c.isalpha() or c == " " for c in piece) < 0.75 * len(piece):
            continue  # tables of numbers and the like are not prose
        yield piece[:cut], piece[cut:]


def document_pairs(seed: int, split: str = "train") -> Iterator[Pair]:
    """Endless corpus-like documents (a title and fact sentences about several people, as ``mot-cag data corpus``
    writes, but from the ``split`` strings) with one question and its answer as the continuation."""
    from mot_cag.data.synthetic import WorldBuilder, render_document

    rng = random.Random(f"documents:{seed}")
    wb = WorldBuilder(rng, split)
    while True:
        wb.reset()
        facts = wb.facts(rng.randint(3, 6), rng.randint(2, 3))
        doc = render_document(facts, rng, title=True, sep=rng.choice([" ", "\n"]))
        fact = rng.choice(facts)
        yield doc, f"\nQuestion: {fact.question()}\nAnswer: {fact.value}."


def real_text_pairs(seed: int, split: str = "train", prose_share: float = 0.5) -> Iterator[Pair]:
    """Training text for real models: corpus-like fact documents and package prose, mixed."""
    rng = random.Random(f"real:{seed}")
    docs, prose = document_pairs(seed, split), prose_pairs(seed, split)
    while True:
        yield next(prose) if rng.random() < prose_share else next(docs)


DATA_SOURCES = ("synthetic", "documents", "prose", "real")
"""Built-in training texts: the zoo's synthetic task, corpus-like documents, package prose, or both (``real``)."""


def pair_stream(data: str, seed: int, repeat_prob: float = 0.3) -> Iterator[Pair]:
    """Endless pairs from ``data`` (a name of :data:`DATA_SOURCES` or a file path), shuffled with ``seed``."""
    if data in ("synthetic", "synthetic:qa", ""):
        yield from synthetic_pairs(seed, repeat_prob)
        return
    if data == "documents":
        yield from document_pairs(seed)
        return
    if data == "prose":
        yield from prose_pairs(seed)
        return
    if data == "real":
        yield from real_text_pairs(seed)
        return
    pairs = file_pairs(data)
    rng = random.Random(seed)
    while True:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for i in order:
            yield pairs[i]
