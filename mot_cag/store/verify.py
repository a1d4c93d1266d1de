"""Checking and repairing a store: every chunk file against its checksums, the index against the manifest,
orphans and leftovers; rebuilding a lost or damaged manifest from the chunk files (``mot-cag store verify``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mot_cag.errors import StoreError
from mot_cag.store import chunkfile
from mot_cag.store.format import (
    DEFAULT_STORE,
    DOCS_DIR,
    INDEX_FILE,
    MANIFEST_FILE,
    StoreConfig,
    StoreSource,
    chunk_key,
    chunk_relpath,
    meta_checksum,
    prefix_digest,
)
from mot_cag.store.index import VectorIndex
from mot_cag.store.lock import WriterLock
from mot_cag.store.manifest import DocumentVersion, Manifest

if TYPE_CHECKING:
    from mot_cag.store.store import Store


@dataclass
class Problem:
    """One finding of :meth:`Store.verify`."""

    kind: str  # damaged | missing | orphan | manifest | index | temp
    subject: str
    detail: str
    fixed: bool = False

    def to_dict(self) -> dict:
        """JSON form."""
        return asdict(self)


@dataclass
class VerifyReport:
    """Outcome of :meth:`Store.verify`.

    ``ok`` is false when committed data is damaged or missing (a chunk file, the manifest); a stale index,
    leftover temporary files and chunk files no document uses are notes: derived or recoverable state.
    """

    store: str
    chunks_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing committed is lost or damaged (after repairs, if any were made)."""
        return all(p.fixed for p in self.problems)

    def to_dict(self) -> dict:
        """JSON form."""
        return {"store": self.store, "ok": self.ok, "chunks_checked": self.chunks_checked,
                "problems": [p.to_dict() for p in self.problems], "notes": [p.to_dict() for p in self.notes]}



class Verifying:
    """The checking half of :class:`~mot_cag.store.store.Store` (a mixin: it uses the store's ``root``,
    ``config``, ``source``, ``manifest`` and index methods)."""

    def verify(self, repair: bool = False, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check every chunk file against its checksums and the index against the manifest.

        Args:
            repair: Fix what can be fixed: drop damaged or missing chunks from the manifest (and the
                documents using them, so the next ingest makes them again), adopt valid orphan files, delete
                leftover temporary files, rebuild and save the index. Needs the writer lock.
            progress: Called with ``(checked, total)``.
        """
        report = VerifyReport(str(self.root))
        qc = self.manifest.quick_check()
        if qc != "ok":
            report.problems.append(Problem("manifest", str(self.root / MANIFEST_FILE), qc))
        rows = list(self.manifest.iter_chunks())
        bad = self._check_rows(report, rows, progress)
        self._note_stray_files(report, {r.key for r in rows})
        self._note_index(report, {r.id for r in rows})
        if repair:
            self._repair(report, bad)
        return report

    def check_chunk(self, key: str, row_checksum: str | None = None) -> str | None:
        """Why stored chunk ``key`` is not a valid copy (see :func:`check_chunk_file`), or ``None``."""
        try:
            tensors, meta = self.chunks.get(key)
        except StoreError:
            return "unreadable header (not a safetensors chunk)"
        return check_chunk_tensors(tensors, meta, key, self.source, row_checksum, self.config.prefix_ids)

    def _check_rows(self, report: VerifyReport, rows: list, progress: Callable[[int, int], None] | None) -> list[str]:
        """Check the file of every manifest row; report and return the keys of missing or damaged ones."""
        bad: list[str] = []
        for n, row in enumerate(rows, 1):
            reason = "file missing" if not self.chunks.contains(row.key) else self.check_chunk(row.key, row.checksum)
            if reason is not None:
                bad.append(row.key)
                report.problems.append(Problem("missing" if reason == "file missing" else "damaged", row.key,
                                               f"{self.file(row.key)}: {reason}"))
            report.chunks_checked = n
            if progress is not None:
                progress(n, len(rows))
        return bad

    def _note_stray_files(self, report: VerifyReport, known: set[str]) -> None:
        """Note temporary files and chunk files without a manifest row (not damage: an interrupted write)."""
        for f in self.chunks.temp_files():
            report.notes.append(Problem("temp", f, "leftover temporary file of an interrupted write"))
        for path in self.chunks.misplaced():
            report.notes.append(Problem("temp", str(path), "chunk file outside the folder its name belongs in "
                                                           "(never read)"))
        for key in self.chunks.keys():
            if key not in known:
                report.notes.append(Problem("orphan", key, f"{self.file(key)}: chunk file with no manifest row (an "
                                                           "interrupted ingest; the next ingest adopts it)"))

    def _note_index(self, report: VerifyReport, ids: set[int]) -> None:
        """Note an index on disk that is unreadable or out of step with the manifest (rebuilt on open)."""
        index_path = self.root / INDEX_FILE
        try:
            on_disk = set(VectorIndex.load(index_path, self.config.embed_dim).ids().tolist()) \
                if index_path.is_file() else set()
        except Exception as e:  # noqa: BLE001
            on_disk = set()
            report.notes.append(Problem("index", str(index_path), f"unreadable ({e}); rebuilt on open"))
        if on_disk != ids:
            report.notes.append(Problem(
                "index", str(index_path), f"index holds {len(on_disk & ids)} of {len(ids)} chunks and "
                f"{len(on_disk - ids)} stale ids; brought up to date on open, saved by the next ingest or --repair"))

    def _repair(self, report: VerifyReport, bad: list[str]) -> None:
        if bad:
            self._drop_bad(report, bad)
        for note in report.notes:
            if note.kind == "temp":
                Path(note.subject).unlink(missing_ok=True)
            elif note.kind == "orphan" and self.adopt_chunk(note.subject) is None:
                self.chunks.delete(note.subject)
            note.fixed = note.kind in ("temp", "orphan")
        self._index = None
        self.sync_index(write=True)
        self.save_index()
        for note in report.notes:
            if note.kind == "index":
                note.fixed = True

    def _drop_bad(self, report: VerifyReport, bad: list[str]) -> None:
        """Remove damaged or missing chunks and the documents using them (the next ingest makes them again)."""
        with self.manifest.transaction():
            docs = {p for k in bad for p, _ in self.manifest.places(k)}
            for d in docs:
                self.manifest.delete_document(d)
            self.manifest.delete_chunks(bad)
        self.chunks.delete_many(bad)
        for p in report.problems:
            if p.kind in ("damaged", "missing"):
                p.fixed = True
                p.detail += "; removed: run the same ingest again to recreate it"


def check_chunk_file(path: Path, key: str, source: StoreSource, row_checksum: str | None = None,
                     prefix_ids: Iterable[int] = ()) -> str | None:
    """Why the chunk file at ``path`` is not a valid copy of chunk ``key``, or ``None`` when it is.

    Checks, in order: the header parses and is a mot-cag chunk (format 1 or 2); the metadata fields are
    intact; the key is the hash of the recorded token ids under this source; the tensor shapes fit the source
    layout; the tensor bytes (KV, and in format 2 the token ids and text) match the recorded checksum (and the
    manifest's, when given); the text is UTF-8.
    """
    try:
        tensors, meta = chunkfile.read_chunk_tensors(path)
    except StoreError:
        return "unreadable header (not a safetensors chunk)"
    return check_chunk_tensors(tensors, meta, key, source, row_checksum, prefix_ids)


def check_chunk_tensors(tensors: dict, meta: dict, key: str, source: StoreSource, row_checksum: str | None = None,
                        prefix_ids: Iterable[int] = ()) -> str | None:
    """:func:`check_chunk_file` on a chunk already read (from any :class:`~mot_cag.store.backend.ChunkBackend`)."""
    if meta.get("key") != key:
        return f"holds chunk {meta.get('key')!r}, expected {key}"
    if meta.get("meta_checksum") != meta_checksum(meta):
        return "metadata fails its checksum"
    try:
        ids = chunkfile.chunk_token_ids(tensors, meta)
    except StoreError:
        return "token ids unreadable"
    reason = _identity_problem(meta, key, ids, source, list(prefix_ids)) or _shape_problem(tensors, meta, ids,
                                                                                          source.layout)
    if reason is not None:
        return reason
    if chunkfile.chunk_checksum(tensors) != meta.get("checksum"):
        return "tensor data fails its checksum"
    try:
        chunkfile.chunk_text(tensors, meta)
    except StoreError as e:
        return f"text unreadable ({e})"
    if row_checksum is not None and row_checksum != meta["checksum"]:
        return "checksum differs from the manifest's"
    return None


def _identity_problem(meta: dict, key: str, ids: list[int], source: StoreSource, prefix_ids: list[int]) -> str | None:
    """Why an intact chunk file's metadata is not chunk ``key`` of this store (same source, prefix and key)."""
    if meta.get("fingerprint") != source.fingerprint:
        return f"made by another source model (fingerprint {meta.get('fingerprint')})"
    if meta.get("prefix", "") != (prefix_digest(prefix_ids) if prefix_ids else ""):
        return f"prefilled after another prefix ({meta.get('prefix') or 'none'}) than this store's"
    if chunk_key(source.fingerprint, ids, prefix_ids) != key:
        return "token ids do not hash to the chunk key"
    if meta.get("start") != "0":
        return f"prefilled at position {meta.get('start')}, store chunks are prefilled at 0"
    return None


def _shape_problem(tensors: dict, meta: dict, ids: list[int], lay) -> str | None:
    """Why a chunk file's tensors do not fit the source layout and its token count."""
    want = [lay.layers, lay.kv_heads, len(ids), lay.head_dim]
    try:
        shapes = [json.loads(meta.get("shape", "[]"))] + [list(tensors[n].shape) for n in chunkfile.KV_TENSORS]
    except json.JSONDecodeError:
        return f"shape {meta.get('shape')!r} unreadable"
    except KeyError as e:
        return f"tensor {e} missing"
    if any(s != want for s in shapes):
        return f"shape {meta.get('shape')} does not fit the source layout {want}"
    return None


# ------------------------------------------------------------------------------------------- repair


def rebuild_manifest(root: str | Path, config: StoreConfig | None = None) -> tuple[Store, list[Problem]]:
    """Rebuild a store's manifest from its chunk files and document records (call under the writer lock).

    The old manifest (if any) is kept beside it as ``manifest.sqlite.damaged-<time>``. Chunk files that fail
    :func:`check_chunk_file` are deleted and reported; a document is restored when all its chunks are.

    Returns:
        The reopened store and the problems found while scanning.
    """
    from mot_cag.store.store import Store

    root = Path(root)
    config = config or Store.read_config(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in ("", "-wal", "-shm"):
        old = root / f"{MANIFEST_FILE}{suffix}"
        if old.exists():
            os.replace(old, root / f"{MANIFEST_FILE}{suffix}.damaged-{stamp}")
    (root / INDEX_FILE).unlink(missing_ok=True)  # its ids referred to the old manifest's rows
    st = Store(root, config, Manifest(root / MANIFEST_FILE))
    problems: list[Problem] = []
    for key in list(st.chunks.keys()):
        reason = st.check_chunk(key)
        if reason is not None:
            st.chunks.delete(key)
            problems.append(Problem("damaged", key, f"{st.file(key)}: {reason}; removed", fixed=True))
            continue
        _, text, meta = st.chunks.content(key)
        with st.manifest.transaction():
            st.manifest.add_chunk(key, chunk_relpath(key), meta["checksum"], int(meta["tokens"]),
                                  st.chunks.size(key), text)
    for rec_path in sorted((root / DOCS_DIR).glob("*.json")):
        try:
            doc = DocumentVersion.from_record(json.loads(rec_path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            problems.append(Problem("manifest", str(rec_path), f"document record unreadable ({e}); skipped"))
            continue
        if all(st.has_chunk(c.key) for c in doc.chunks):
            with st.manifest.transaction():
                st.manifest.put_document(doc)
        else:
            problems.append(Problem("missing", doc.path, "document lost chunks; re-ingest it", fixed=True))
    st.sync_index(write=True)
    st.save_index()
    return st, problems


def verify_store(path: str | Path = DEFAULT_STORE, repair: bool = False,
                 progress: Callable[[int, int], None] | None = None, lock_timeout: float | None = 0) -> VerifyReport:
    """Verify the store at ``path`` (see :meth:`Store.verify`), rebuilding a damaged manifest with ``repair``.

    Raises:
        StoreError: No store at ``path``; with ``repair``, another writer holds the store.
    """
    from mot_cag.store.store import Store

    root = Path(path)
    config = Store.read_config(root)
    if not repair:
        try:
            st = Store.open(root)
        except StoreError as e:
            report = VerifyReport(str(root))
            report.problems.append(Problem("manifest", str(root / MANIFEST_FILE), str(e)))
            return report
        with st:
            return st.verify(progress=progress)
    with WriterLock(root, timeout=lock_timeout):
        rebuilt: list[Problem] = []
        try:
            st = Store.open(root)
            qc = st.manifest.quick_check()
            if qc != "ok":
                st.close()
                raise StoreError(qc)
        except StoreError as e:
            st, rebuilt = rebuild_manifest(root, config)
            rebuilt.insert(0, Problem("manifest", str(root / MANIFEST_FILE), f"{e}; rebuilt from chunk files",
                                      fixed=True))
        with st:
            report = st.verify(repair=True, progress=progress)
        report.problems[:0] = rebuilt
        return report
