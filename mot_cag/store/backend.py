"""Where a store's chunk files live: the small storage interface (put / get / contains / delete / close,
keyed by content key) and its one implementation, files on the local disk.

A chunk file is self-describing bytes (:mod:`mot_cag.store.chunkfile`: safetensors with its metadata). The
manifest, the vector index and the document records stay local files of the store folder; a new place for
the chunks (an object store, a shared cache) is one subclass of :class:`ChunkBackend` here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from mot_cag.store import chunkfile
from mot_cag.store.format import CHUNKS_DIR, chunk_relpath


class ChunkBackend(ABC):
    """Chunk bytes by content key. Batched verbs default to loops over the single ones.

    A write is atomic: a reader sees the whole chunk or none of it. With ``durable=False`` it may be lost by a
    power cut until the store's group commit syncs it (``Store.sync_files``); the manifest row comes after.
    """

    @abstractmethod
    def put(self, key: str, data: bytes, durable: bool = True) -> str:
        """Store chunk ``key``'s bytes; returns the locator the manifest records for it.

        Raises:
            OSError: The write failed (nothing is left under the key's name).
        """

    @abstractmethod
    def get(self, key: str, names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Chunk ``key``'s tensors (only ``names``, when given) and metadata.

        Raises:
            chunkfile.ChunkFileMissing: No such chunk.
            StoreError: The bytes are not a chunk file.
        """

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether chunk ``key`` is stored."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove chunk ``key`` (no error when it is absent)."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Every stored chunk key, in a stable order (rebuild, garbage collection, orphan checks)."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Bytes chunk ``key`` takes."""

    def remove_temp(self) -> int:
        """Remove leftovers of interrupted writes (only the writer-lock holder calls this); returns how many."""
        return 0

    def temp_files(self) -> list[str]:
        """Leftovers of interrupted writes, for reports."""
        return []

    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release what the backend holds."""

    def content(self, key: str) -> tuple[list[int], str, dict[str, str]]:
        """Token ids, text and metadata of chunk ``key`` (the KV is not decoded)."""
        tensors, meta = self.get(key, ("token_ids", "text_utf8"))
        return chunkfile.chunk_token_ids(tensors, meta), chunkfile.chunk_text(tensors, meta), meta

    def delete_many(self, keys: Iterable[str]) -> None:
        """Remove several chunks."""
        for key in keys:
            self.delete(key)

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """:meth:`contains` of each key."""
        return [self.contains(k) for k in keys]


class DiskChunks(ChunkBackend):
    """Chunk files under ``<store>/chunks/<first two hex digits>/<key>.safetensors``, read memory-mapped."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        """The file of chunk ``key`` (disk only: verification and benchmarks read files)."""
        return self.root / chunk_relpath(key)

    def put(self, key: str, data: bytes, durable: bool = True) -> str:
        rel = chunk_relpath(key)
        path = self.root / rel
        try:
            chunkfile.write_atomic(path, data, durable=durable)
        except OSError:
            for tmp in path.parent.glob(f".{path.name}.*.tmp"):
                tmp.unlink(missing_ok=True)
            raise
        return rel

    def get(self, key: str, names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        # A string path: building a Path costs more than the stat on this hot path.
        return chunkfile.read_chunk_tensors(f"{self.root}/{chunk_relpath(key)}", names)

    def content(self, key: str) -> tuple[list[int], str, dict[str, str]]:
        return chunkfile.read_content(self.path(key))

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> Iterator[str]:
        for f in sorted((self.root / CHUNKS_DIR).glob("*/*.safetensors")):
            if f.parent.name == f.stem[:2]:
                yield f.stem

    def misplaced(self) -> list[Path]:
        """Chunk files outside the folder their name belongs in (copied or moved by hand): never read, so
        garbage for ``store gc``."""
        return [f for f in sorted((self.root / CHUNKS_DIR).glob("*/*.safetensors")) if f.parent.name != f.stem[:2]]

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def temp_files(self) -> list[str]:
        return [str(f) for f in sorted((self.root / CHUNKS_DIR).glob("*/.*.tmp"))]

    def remove_temp(self) -> int:
        gone = self.temp_files()
        for f in gone:
            Path(f).unlink(missing_ok=True)
        return len(gone)


def disk_has_chunks(root: str | Path) -> bool:
    """Whether a store folder holds any chunk file (a store whose manifest is gone can be rebuilt)."""
    return next(DiskChunks(root).keys(), None) is not None


__all__ = ["ChunkBackend", "DiskChunks", "disk_has_chunks"]
