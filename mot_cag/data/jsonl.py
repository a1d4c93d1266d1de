"""JSONL files (one JSON object per line, UTF-8): the datasets, corpora and questions mot-cag writes and reads."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from mot_cag.errors import MotCagError


def write_jsonl(examples: Iterable[dict], path: str | Path) -> Path:
    """Write examples to a JSONL file (one JSON object per line, UTF-8); creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps(ex, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a local JSONL file (one object per line), or of a JSON file holding a list of objects; read with
    the ``json`` module (no cache files, no ``datasets`` import).

    Raises:
        MotCagError: The file is missing, unreadable, or holds a line that is not one JSON object (named).
    """
    path = Path(path)
    if not path.is_file():
        raise MotCagError(f"Dataset file {path} does not exist; give a JSONL file or a synthetic:TASK name.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MotCagError(f"Cannot read {path} ({e}); give a UTF-8 JSONL file.") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise MotCagError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}).") from None
        lines = [(n + 1, r) for n, r in enumerate(rows)]
    else:
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                lines.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise MotCagError(f"{path}, line {n}: not a JSON object ({e.msg}); each line must be one JSON "
                                  "object.") from None
    bad = next((n for n, r in lines if not isinstance(r, dict)), None)
    if bad is not None:
        raise MotCagError(f"{path}, line {bad}: not a JSON object; each line must be one JSON object.")
    return [r for _, r in lines]
