"""Evaluation datasets: built-in synthetic tasks, JSONL files, and Hugging Face QA sets mapped to one schema.

Every example is a dict with ``id``, ``context``, ``question``, ``answer`` and optionally ``cue``,
``options``/``answer_index`` (closed set), ``task`` (``repeat``), ``doc`` (the file holding the answer when
contexts come from a store).
"""

from __future__ import annotations

from pathlib import Path

from mot_cag.data.jsonl import read_jsonl
from mot_cag.errors import MotCagError

# Hugging Face QA sets and how their fields map onto ours.
HF_MAPPINGS = {
    "squad": ("rajpurkar/squad", "validation"),
    "rajpurkar/squad": ("rajpurkar/squad", "validation"),
    "boolq": ("google/boolq", "validation"),
    "google/boolq": ("google/boolq", "validation"),
    "hotpotqa": ("hotpotqa/hotpot_qa", "validation"),
    "hotpotqa/hotpot_qa": ("hotpotqa/hotpot_qa", "validation"),
}


def _from_hf_row(row: dict, i: int) -> dict:
    if "answers" in row and isinstance(row["answers"], dict):  # SQuAD
        return {"id": str(row.get("id", i)), "context": row["context"], "question": row["question"],
                "answer": row["answers"]["text"][0] if row["answers"]["text"] else ""}
    if "passage" in row and "answer" in row:  # BoolQ
        ans = "yes" if row["answer"] else "no"
        return {"id": str(i), "context": row["passage"], "question": row["question"] + "?", "answer": ans,
                "options": ["yes", "no"], "answer_index": 0 if row["answer"] else 1}
    if "context" in row and isinstance(row["context"], dict) and "sentences" in row["context"]:  # HotpotQA
        paragraphs = [" ".join(s) for s in row["context"]["sentences"]]
        return {"id": str(row.get("id", i)), "context": "\n".join(paragraphs), "question": row["question"],
                "answer": row["answer"]}
    return {"id": str(row.get("id", i)), **{k: row[k] for k in ("context", "question", "answer") if k in row}}


def load_examples(name: str, limit: int | None = None, seed: int = 0, **synth_kwargs) -> list[dict]:
    """Load a dataset by name or path.

    Args:
        name: ``synthetic:TASK`` (qa, closed, repeat, needle, multikey, multihop), a JSONL file, or a Hugging
            Face dataset name available offline (squad, boolq, hotpotqa, ...).
        limit: Keep at most this many examples (synthetic default: 100).
        seed: Seed of synthetic data.
        **synth_kwargs: Extra arguments of :func:`mot_cag.data.synthetic.synth_dataset`.

    Raises:
        MotCagError: Unknown name, unreadable file, or malformed rows.
    """
    if name.startswith("synthetic:"):
        from mot_cag.data.synthetic import synth_dataset

        try:
            return synth_dataset(name.split(":", 1)[1], limit or 100, seed, **synth_kwargs)
        except ValueError as e:
            raise MotCagError(str(e)) from None
    path = Path(name)
    if path.suffix in (".jsonl", ".json") or path.exists():
        rows = read_jsonl(path)
    else:
        rows = _load_hf(name)
    rows = rows[:limit] if limit else rows
    for i, row in enumerate(rows):
        missing = [k for k in ("question", "answer") if k not in row] + (["context"] if "context" not in row else [])
        if missing:
            raise MotCagError(f"Example {i} of {name} lacks {', '.join(missing)}; every line needs "
                              '"id", "context", "question", "answer".')
        row.setdefault("id", str(i))
    return rows


def _datasets():
    """The ``datasets`` module, quiet (no progress bars on stderr)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _load_hf(name: str) -> list[dict]:
    repo, split = HF_MAPPINGS.get(name.lower(), (name, "validation"))
    try:
        ds = _datasets().load_dataset(repo, split=split)
    except Exception:  # noqa: BLE001 - offline, missing, or unknown
        raise MotCagError(
            f"Dataset '{name}' is neither a file, a synthetic:TASK name, nor a Hugging Face dataset available "
            "offline here; pass a JSONL file or run where the hub is reachable."
        ) from None
    return [_from_hf_row(dict(r), i) for i, r in enumerate(ds)]
