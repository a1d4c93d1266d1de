"""Store management: list documents, remove documents, collect garbage (``mot-cag store ls | rm | gc``).

Crash safety follows ingest's rule, in reverse: what a reader relies on goes first. Removing a document
deletes its record file, then (in one manifest transaction) its rows and the rows of chunks nothing else uses,
then the chunk files, then the index entries. A process killed at any point leaves a store that verifies: at
worst chunk files without a row (notes that ``gc`` deletes) or an index with stale ids (dropped on open). A
chunk whose document is gone is never retrieved, since search only returns chunks with a document.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mot_cag.errors import StoreError
from mot_cag.store import chunkfile
from mot_cag.store.format import DOCS_DIR
from mot_cag.store.lock import WriterLock
from mot_cag.store.store import Store


@dataclass
class Removed:
    """What :func:`remove_documents` or :func:`gc` deleted."""

    documents: list[str] = field(default_factory=list)
    chunks: int = 0
    chunk_files: int = 0
    records: int = 0
    temp_files: int = 0
    bytes_freed: int = 0

    def to_json(self) -> dict:
        return {"documents_removed": len(self.documents), "documents": self.documents, "chunks_removed": self.chunks,
                "chunk_files_removed": self.chunk_files, "records_removed": self.records,
                "temp_files_removed": self.temp_files, "bytes_freed": self.bytes_freed}


def documents(store: str | Path) -> list[dict]:
    """Every complete document of the store: path, chunks, tokens, size and content hash."""
    with Store.open(store) as st:
        return [{"path": d.path, "chunks": d.chunks, "tokens": d.tokens, "size": d.size, "sha256": d.sha256}
                for d in st.manifest.documents()]


def _under(doc: str, roots: list[str]) -> bool:
    return any(doc == r or doc.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def matching_documents(st: Store, paths: Iterable[str | Path]) -> list[str]:
    """Documents of ``st`` at or under ``paths`` (files or folders, resolved like ingest resolves them)."""
    roots = [str(Path(p).expanduser().resolve()) for p in paths]
    return [d.path for d in st.manifest.documents() if _under(d.path, roots)]


def drop_documents(st: Store, paths: list[str], removed: Removed | None = None) -> Removed:
    """Remove documents from an open store (the caller holds the writer lock); see the module docstring."""
    removed = removed or Removed()
    if not paths:
        return removed
    for p in paths:
        st.document_record(p).unlink(missing_ok=True)
    removed.records += len(paths)
    chunkfile._fsync_dir(st.root / DOCS_DIR)
    m = st.manifest
    with m.transaction():
        keys = {c.key for p in paths if (d := m.document(p)) is not None for c in m.doc_chunks(d.id)}
        for p in paths:
            m.delete_document(p)
        gone = m.delete_chunks(m.unreferenced(sorted(keys)))
    _unlink_chunks(st, gone, removed)
    removed.documents += paths
    st.save_index()
    return removed


def _unlink_chunks(st: Store, rows, removed: Removed) -> None:
    for row in rows:
        if st.chunks.contains(row.key):
            removed.bytes_freed += st.chunks.size(row.key)
            st.chunks.delete(row.key)
            removed.chunk_files += 1
    removed.chunks += len(rows)


def remove_documents(store: str | Path, paths: Iterable[str | Path], lock_timeout: float | None = None) -> Removed:
    """``mot-cag store rm``: remove the documents at or under ``paths`` and the chunks only they used.

    Raises:
        StoreError: No store there, or no document of it is at or under any of ``paths``.
    """
    paths = list(paths)
    root = Path(store)
    Store.read_config(root)  # a clear error when there is no store
    with WriterLock(root, timeout=lock_timeout), Store.open(root) as st:
        docs = matching_documents(st, paths)
        if not docs:
            shown = ", ".join(str(p) for p in paths[:3])
            raise StoreError(f"No document of store {root} is at or under {shown}; `mot-cag store ls --store {root}` "
                             "lists them.")
        return drop_documents(st, docs)


def gc(store: str | Path, lock_timeout: float | None = None) -> Removed:
    """``mot-cag store gc``: delete what no document uses.

    Chunk rows no document references, chunk files without a row (an interrupted ingest or removal),
    document records of documents the manifest does not hold, temporary files of dead writers; then the index
    is brought in line with the manifest and saved.
    """
    root = Path(store)
    Store.read_config(root)
    removed = Removed()
    with WriterLock(root, timeout=lock_timeout), Store.open(root) as st:
        removed.temp_files = st.remove_temp_files()
        m = st.manifest
        with m.transaction():
            gone = m.delete_chunks(m.unreferenced_chunks())
        _unlink_chunks(st, gone, removed)
        known = {r.key for r in m.iter_chunks()}
        for key in list(st.chunks.keys()):
            if key not in known:
                removed.bytes_freed += st.chunks.size(key)
                st.chunks.delete(key)
                removed.chunk_files += 1
        for f in st.chunks.misplaced():
            removed.bytes_freed += f.stat().st_size
            f.unlink()
            removed.chunk_files += 1
        for rec in sorted((root / DOCS_DIR).glob("*.json")):
            try:
                path = json.loads(rec.read_text(encoding="utf-8"))["path"]
            except (OSError, ValueError, KeyError, TypeError):
                path = None  # a damaged record restores nothing
            if path is None or m.document(path) is None:
                rec.unlink()
                removed.records += 1
        st.save_index()
    return removed
