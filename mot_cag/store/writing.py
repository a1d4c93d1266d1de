"""Writing a store: chunk files (atomic, group-committed), their manifest rows, document records, and
deleting chunks no document uses. Only the holder of the writer lock (lock.py) calls these."""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mot_cag.errors import StoreError
from mot_cag.models.cache import KVChunk
from mot_cag.store import chunkfile
from mot_cag.store.format import DOCS_DIR, TextChunk, chunk_relpath, meta_checksum, prefix_digest
from mot_cag.store.manifest import ChunkRow, DocumentVersion


@dataclass(frozen=True)
class WrittenChunk:
    """A chunk file on disk whose manifest row is still to be committed."""

    key: str
    file: str
    checksum: str
    tokens: int
    bytes: int
    text: str



class Writing:
    """The writing half of :class:`~mot_cag.store.store.Store` (a mixin: it uses the store's ``root``,
    ``config``, ``source``, ``manifest``, ``embedder`` and ``_index``)."""

    def has_chunk(self, key: str) -> bool:
        """Whether the manifest has chunk ``key``."""
        return self.manifest.chunk(key) is not None

    def write_chunk_file(self, kv: KVChunk, chunk: TextChunk, doc: str, key: str,
                         durable: bool = True) -> WrittenChunk:
        """Write chunk ``key``'s file atomically (temporary name, rename), without touching the manifest.

        Args:
            kv: The chunk's KV, prefilled at position 0.
            chunk: Its text, offsets and token ids.
            doc: Path of the document it was cut from.
            key: Its content key.
            durable: fsync the file and its folder now. With ``False`` the caller must call
                :meth:`sync_files` before committing the row (group commit: one filesystem sync per batch).

        Raises:
            StoreError: The disk is full (or another write error); the temporary file is removed.
        """
        # Token ids and text go in tensors (chunk format 2), not in the metadata that every load parses.
        meta = {
            "key": key, "source": self.source.name, "fingerprint": self.source.fingerprint, "doc": doc,
            "chunk_index": str(chunk.index), "char_start": str(chunk.char_start), "char_end": str(chunk.char_end),
            "special_tokens": "none",
        }
        if self.config.prefix_ids:
            meta["prefix"] = prefix_digest(self.config.prefix_ids)
        meta["meta_checksum"] = meta_checksum(meta)
        try:
            data, written = chunkfile.encode_chunk(kv, self.source.layout, self.config.torch_dtype, meta,
                                                   token_ids=chunk.token_ids, text=chunk.text)
            rel = self.chunks.put(key, data, durable=durable)
            nbytes = len(data)
        except OSError as e:
            what = "the disk is full" if e.errno == errno.ENOSPC else f"writing failed ({e})"
            raise StoreError(f"Cannot write chunk {key} to {self.root}: {what}; free space and run the same ingest "
                             "again to resume (everything committed so far is kept).") from None
        return WrittenChunk(key, rel, written["checksum"], kv.length, nbytes, chunk.text)

    def sync_files(self, written: list[Path] | None = None) -> None:
        """Make files written with ``durable=False`` durable (one filesystem sync)."""
        chunkfile.sync_filesystem(self.root, written)

    def commit_chunk(self, w: WrittenChunk) -> ChunkRow:
        """Commit the manifest row of a chunk file that :meth:`write_chunk_file` wrote."""
        self.commit_chunks([w])
        return self.manifest.chunk(w.key)  # type: ignore[return-value]

    def commit_chunks(self, written: list[WrittenChunk]) -> None:
        """Commit the rows of several written chunk files in one transaction."""
        if not written:
            return
        with self.manifest.transaction():
            for w in written:
                self.manifest.add_chunk(w.key, w.file, w.checksum, w.tokens, w.bytes, w.text)

    def adopt_chunk(self, key: str) -> ChunkRow | None:
        """Take an existing, valid chunk file that has no manifest row (a crash after the rename) into the
        manifest, so resuming does not prefill it again. Returns ``None`` when there is no usable file."""
        if not self.chunks.contains(key) or self.check_chunk(key) is not None:
            return None
        _, text, meta = self.chunks.content(key)
        with self.manifest.transaction():
            self.manifest.add_chunk(key, chunk_relpath(key), meta["checksum"], int(meta["tokens"]),
                                    self.chunks.size(key), text)
        return self.manifest.chunk(key)

    def remove_temp_files(self) -> int:
        """Delete temporary files of interrupted writes. Only the writer-lock holder may call this: any
        temporary file it sees belongs to a writer that died."""
        n = self.chunks.remove_temp()
        for pattern in (f"{DOCS_DIR}/.*.tmp", ".*.tmp"):
            for tmp in self.root.glob(pattern):
                tmp.unlink(missing_ok=True)
                n += 1
        return n

    def embed_pending(self) -> int:
        """Embed chunks that have no embedding yet, store the vectors and add them to the index."""
        pending = self.manifest.missing_embeddings()
        if not pending:
            return 0
        vecs = self.embedder.encode([t for _, t in pending])
        ids = [i for i, _ in pending]
        with self.manifest.transaction():
            self.manifest.set_embeddings(ids, vecs)
        if self._index is not None:
            self._index.add(ids, vecs)
        return len(ids)

    def put_document(self, doc: DocumentVersion, write_record: bool = True) -> int:
        """Commit a complete document, write its record, and delete chunks only its old version used.

        Args:
            doc: The document (absolute path, content hash, size, mtime, its chunks in order, tokens).
            write_record: Write ``documents/<id>.json`` now; pass ``False`` to write it yourself with
                :meth:`write_document_record` (e.g. before a group commit's filesystem sync).

        Returns:
            Number of chunks removed.
        """
        with self.manifest.transaction():
            old_keys = self.manifest.put_document(doc)
        if write_record:
            self.write_document_record(doc)
        return self.collect(set(old_keys) - {c.key for c in doc.chunks})

    def write_document_record(self, doc: DocumentVersion, durable: bool = True) -> Path:
        """Write a document's JSON record atomically (what :func:`rebuild_manifest` restores documents from).

        With ``durable=False`` it becomes durable at the next :meth:`sync_files`.
        """
        record = self.document_record(doc.path)
        chunkfile.write_atomic(record, json.dumps(doc.to_record(), indent=1, sort_keys=True).encode(),
                               durable=durable)
        return record

    def document_record(self, path: str) -> Path:
        """Where the JSON record of document ``path`` lives (what :func:`rebuild_manifest` reads)."""
        return self.root / DOCS_DIR / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"

    def collect(self, keys: Iterable[str]) -> int:
        """Delete those of ``keys`` that no document uses: manifest rows first, then files, then vectors."""
        with self.manifest.transaction():
            gone = self.manifest.delete_chunks(self.manifest.unreferenced(keys))
        self.chunks.delete_many(row.key for row in gone)
        if gone and self._index is not None:
            self._index.remove([r.id for r in gone])
        return len(gone)
