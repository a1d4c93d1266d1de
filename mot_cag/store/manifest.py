"""The store's manifest: documents, chunks, their files, checksums and index ids, in SQLite (WAL).

Tables:

* ``chunks``: one row per chunk file. ``id`` is the FAISS id (``AUTOINCREMENT``, so an id is never reused
  after a delete and a stale index cannot point at the wrong chunk); ``key`` the content hash; ``file`` the
  path relative to the store; ``embedding`` the float32 vector, so the index can be rebuilt without the
  embedding model.
* ``documents``: one row per ingested file, written only once all its chunks exist, so a document row
  always means "complete".
* ``doc_chunks``: which chunk is the i-th of which document, with its character offsets. A chunk shared by
  two documents (same text, same tokens) has one ``chunks`` row and two ``doc_chunks`` rows.

Durability: WAL with ``synchronous=NORMAL``. A killed process loses nothing committed; a power cut may lose
the last commits but never corrupts the database, and rows lost that way point at chunk files that the next
ingest finds on disk and adopts without prefilling again.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    file TEXT NOT NULL,
    checksum TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    text TEXT NOT NULL,
    embedding BLOB
);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL UNIQUE,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    chunks INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    ingested_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS doc_chunks (
    doc_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    chunk_index INTEGER NOT NULL,
    chunk_key TEXT NOT NULL,
    char_start INTEGER NOT NULL,
    char_end INTEGER NOT NULL,
    PRIMARY KEY (doc_id, chunk_index)
);
CREATE INDEX IF NOT EXISTS doc_chunks_by_key ON doc_chunks(chunk_key);
"""

# Full-text index of chunk texts for the lexical half of hybrid search (SQLite FTS5, BM25 ranking). It holds no
# text of its own (external content: the ``chunks`` table) and triggers keep it in step with every insert and
# delete, inside the same transaction, so it can never disagree with the rows after a crash.
_FTS_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, content='chunks', content_rowid='id');
CREATE TRIGGER IF NOT EXISTS chunks_fts_ins AFTER INSERT ON chunks BEGIN
    INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER IF NOT EXISTS chunks_fts_del AFTER DELETE ON chunks BEGIN
    INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);
END;
INSERT INTO chunks_fts(chunks_fts) VALUES ('rebuild');
"""

_WORD = re.compile(r"\w+", re.UNICODE)


def fts_query(text: str) -> str:
    """An FTS5 query matching any word of ``text`` (each word quoted, so no word is read as an operator)."""
    terms = dict.fromkeys(w.lower() for w in _WORD.findall(text))
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


@dataclass(frozen=True)
class ChunkRow:
    """A ``chunks`` row (without the embedding)."""

    id: int
    key: str
    file: str
    checksum: str
    tokens: int
    bytes: int
    text: str


@dataclass(frozen=True)
class DocChunk:
    """A chunk's place in one document."""

    index: int
    key: str
    char_start: int
    char_end: int


@dataclass(frozen=True)
class DocumentVersion:
    """One version of a document as ingest cut it: what the manifest row, its chunk places and the JSON
    document record (``documents/<id>.json``, what a rebuild restores from) all hold."""

    path: str
    sha256: str
    size: int
    mtime_ns: int
    chunks: list[DocChunk]
    tokens: int

    def to_record(self) -> dict:
        """JSON form of the document record."""
        return {"path": self.path, "sha256": self.sha256, "size": self.size, "mtime_ns": self.mtime_ns,
                "tokens": self.tokens, "chunks": [asdict(c) for c in self.chunks]}

    @classmethod
    def from_record(cls, rec: dict) -> DocumentVersion:
        """Inverse of :meth:`to_record`.

        Raises:
            KeyError, TypeError: The record lacks a field or has the wrong shape.
        """
        chunks = [DocChunk(c["index"], c["key"], c["char_start"], c["char_end"]) for c in rec["chunks"]]
        return cls(rec["path"], rec["sha256"], rec["size"], rec["mtime_ns"], chunks, rec["tokens"])


@dataclass(frozen=True)
class DocumentRow:
    """A complete document."""

    id: int
    path: str
    sha256: str
    size: int
    mtime_ns: int
    chunks: int
    tokens: int


class Manifest:
    """SQLite manifest of one store.

    Safe to share between threads: each thread gets its own SQLite connection (opened on its first query),
    so readers in a thread pool or under asyncio never share a cursor. Writes still go through one writer
    (the store's writer lock) and its :meth:`transaction`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        db = self.db
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunks_fts'").fetchone() is None:
            # A store made before the full-text index: build it once from the chunk texts.
            # (Two processes racing here both rebuild; the second rebuild is a no-op in effect.)
            db.executescript("BEGIN IMMEDIATE;" + _FTS_SCHEMA + "COMMIT;")

    @property
    def db(self) -> sqlite3.Connection:
        """This thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise sqlite3.ProgrammingError(f"The manifest {self.path} is closed.")
            # isolation_level=None: we open transactions explicitly, so a batch is one commit.
            # check_same_thread=False only so close() can close every thread's connection; each connection
            # is used by its own thread.
            conn = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection (checkpointing the WAL when last)."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    def transaction(self):
        """Context manager: ``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on error)."""
        return _Tx(self.db)

    def quick_check(self) -> str:
        """SQLite's own consistency check: ``"ok"`` or the first problem."""
        return str(self.db.execute("PRAGMA quick_check").fetchone()[0])

    # ------------------------------------------------------------------------------------------ chunks

    def chunk(self, key: str) -> ChunkRow | None:
        """The row of ``key``, if present."""
        r = self.db.execute("SELECT id, key, file, checksum, tokens, bytes, text FROM chunks WHERE key = ?",
                            (key,)).fetchone()
        return ChunkRow(*r) if r else None

    def chunks_by_id(self, ids: Iterable[int]) -> dict[int, ChunkRow]:
        """Rows for chunk ids (missing ids are left out)."""
        ids = list(ids)
        out: dict[int, ChunkRow] = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            marks = ",".join("?" * len(part))
            q = f"SELECT id, key, file, checksum, tokens, bytes, text FROM chunks WHERE id IN ({marks})"
            out.update({r[0]: ChunkRow(*r) for r in self.db.execute(q, part)})
        return out

    def iter_chunks(self) -> Iterator[ChunkRow]:
        """Every chunk row, by id."""
        yield from (ChunkRow(*r) for r in self.db.execute(
            "SELECT id, key, file, checksum, tokens, bytes, text FROM chunks ORDER BY id"))

    def add_chunk(self, key: str, file: str, checksum: str, tokens: int, nbytes: int, text: str) -> int:
        """Insert a chunk row (idempotent on ``key``) and return its id."""
        self.db.execute(
            "INSERT OR IGNORE INTO chunks (key, file, checksum, tokens, bytes, text) VALUES (?, ?, ?, ?, ?, ?)",
            (key, file, checksum, tokens, nbytes, text),
        )
        return int(self.db.execute("SELECT id FROM chunks WHERE key = ?", (key,)).fetchone()[0])

    def set_embeddings(self, ids: list[int], vecs: np.ndarray) -> None:
        """Store float32 embeddings (``[n, dim]``) for chunk ids."""
        self.db.executemany("UPDATE chunks SET embedding = ? WHERE id = ?",
                            [(vecs[i].astype(np.float32).tobytes(), cid) for i, cid in enumerate(ids)])

    def missing_embeddings(self) -> list[tuple[int, str]]:
        """``(id, text)`` of chunks whose embedding was not stored yet (an interrupted ingest)."""
        return list(self.db.execute("SELECT id, text FROM chunks WHERE embedding IS NULL ORDER BY id"))

    def embeddings(self, dim: int, ids: Iterable[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [n] int64, vectors [n, dim] float32)`` of chunks with a stored embedding."""
        if ids is None:
            rows = list(self.db.execute("SELECT id, embedding FROM chunks WHERE embedding IS NOT NULL ORDER BY id"))
        else:
            ids = list(ids)
            rows = []
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                rows += self.db.execute(
                    f"SELECT id, embedding FROM chunks WHERE embedding IS NOT NULL AND id IN "
                    f"({','.join('?' * len(part))})", part).fetchall()
        out_ids = np.array([r[0] for r in rows], dtype=np.int64)
        vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
        return out_ids, vecs

    def delete_chunks(self, keys: Iterable[str]) -> list[ChunkRow]:
        """Delete chunk rows (and any document link to them); returns what was deleted."""
        gone = []
        for key in keys:
            row = self.chunk(key)
            if row is None:
                continue
            self.db.execute("DELETE FROM doc_chunks WHERE chunk_key = ?", (key,))
            self.db.execute("DELETE FROM chunks WHERE key = ?", (key,))
            gone.append(row)
        return gone

    def unreferenced(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` that no document uses."""
        return [k for k in keys if self.db.execute(
            "SELECT 1 FROM doc_chunks WHERE chunk_key = ? LIMIT 1", (k,)).fetchone() is None]

    def unreferenced_chunks(self) -> list[str]:
        """Keys of every chunk that no document uses (garbage of removals and interrupted ingests)."""
        return [r[0] for r in self.db.execute(
            "SELECT key FROM chunks WHERE NOT EXISTS (SELECT 1 FROM doc_chunks d WHERE d.chunk_key = chunks.key) "
            "ORDER BY id")]

    # --------------------------------------------------------------------------------------- documents

    def document(self, path: str) -> DocumentRow | None:
        """The complete document at ``path``, if any."""
        r = self.db.execute("SELECT id, path, sha256, size, mtime_ns, chunks, tokens FROM documents WHERE path = ?",
                            (path,)).fetchone()
        return DocumentRow(*r) if r else None

    def documents(self) -> list[DocumentRow]:
        """Every complete document, by path."""
        return [DocumentRow(*r) for r in self.db.execute(
            "SELECT id, path, sha256, size, mtime_ns, chunks, tokens FROM documents ORDER BY path")]

    def doc_chunks(self, doc_id: int) -> list[DocChunk]:
        """A document's chunks in order."""
        return [DocChunk(*r) for r in self.db.execute(
            "SELECT chunk_index, chunk_key, char_start, char_end FROM doc_chunks WHERE doc_id = ? "
            "ORDER BY chunk_index", (doc_id,))]

    def places(self, key: str) -> list[tuple[str, DocChunk]]:
        """Every ``(document path, place)`` where chunk ``key`` occurs."""
        return [(r[0], DocChunk(*r[1:])) for r in self.db.execute(
            "SELECT d.path, c.chunk_index, c.chunk_key, c.char_start, c.char_end FROM doc_chunks c "
            "JOIN documents d ON d.id = c.doc_id WHERE c.chunk_key = ? ORDER BY d.path, c.chunk_index", (key,))]

    def put_document(self, doc: DocumentVersion) -> list[str]:
        """Insert or replace a complete document; returns the chunk keys its previous version used."""
        old = self.document(doc.path)
        old_keys: list[str] = []
        if old is not None:
            old_keys = [c.key for c in self.doc_chunks(old.id)]
            self.db.execute("DELETE FROM documents WHERE id = ?", (old.id,))
        cur = self.db.execute(
            "INSERT INTO documents (path, sha256, size, mtime_ns, chunks, tokens, ingested_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (doc.path, doc.sha256, doc.size, doc.mtime_ns, len(doc.chunks), doc.tokens, time.time()))
        doc_id = cur.lastrowid
        self.db.executemany("INSERT INTO doc_chunks VALUES (?, ?, ?, ?, ?)",
                            [(doc_id, c.index, c.key, c.char_start, c.char_end) for c in doc.chunks])
        return old_keys

    def touch_document(self, doc_id: int, mtime_ns: int) -> None:
        """Record a new modification time for content that did not change."""
        self.db.execute("UPDATE documents SET mtime_ns = ? WHERE id = ?", (mtime_ns, doc_id))

    def delete_document(self, path: str) -> None:
        """Forget a document (its chunks stay until nothing uses them)."""
        self.db.execute("DELETE FROM documents WHERE path = ?", (path,))

    # ---------------------------------------------------------------------------------------- searching

    def chunk_ids(self) -> set[int]:
        """Ids of every chunk row (what the vector index must hold)."""
        return {r[0] for r in self.db.execute("SELECT id FROM chunks")}

    def chunk_state(self) -> tuple[int, int]:
        """``(chunk count, newest id)``: changes whenever chunks are added or deleted."""
        n, top = self.db.execute("SELECT COUNT(*), COALESCE(MAX(id), 0) FROM chunks").fetchone()
        return int(n), int(top)

    def lexical_scores(self, query: str, limit: int) -> dict[int, float]:
        """BM25 scores (higher is better) of the ``limit`` chunks best matching any word of ``query``.

        Entity names (people, places, codes) are rare words that sentence embedders blur; BM25 weights them by
        inverse document frequency, so mixing it into retrieval lifts recall for fact questions.
        """
        q = fts_query(query)
        if not q:
            return {}
        rows = self.db.execute("SELECT rowid, bm25(chunks_fts) AS s FROM chunks_fts WHERE chunks_fts MATCH ? "
                               "ORDER BY s LIMIT ?", (q, int(limit)))
        return {int(i): -float(s) for i, s in rows}

    # ------------------------------------------------------------------------------------------ totals

    def totals(self) -> dict[str, int]:
        """``documents``, ``chunks``, ``tokens`` (stored, each chunk once) and ``bytes`` of chunk files."""
        docs = self.db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
        chunks, tokens, nbytes = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(tokens), 0), COALESCE(SUM(bytes), 0) FROM chunks").fetchone()
        return {"documents": int(docs), "chunks": int(chunks), "tokens": int(tokens), "bytes": int(nbytes)}


class _Tx:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
