"""Retrieval index: a FAISS inner-product index over chunk embeddings (BM25 lives in the manifest, SQLite FTS5).

Both are *derived* data. The manifest keeps every chunk's embedding, so the FAISS file can always be rebuilt
from it; a stale or missing index file costs time, never data. Vectors are keyed by the manifest's chunk id
(``int64``), never by position, so removing chunks cannot shift other ids.

Index kind: exact (``IndexFlatIP``) up to :data:`IVF_THRESHOLD` vectors, ``IndexIVFFlat`` above it (trained
on the vectors it holds, searched with ``nprobe`` lists); searched on a GPU when faiss-gpu and CUDA are there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

#: Above this many vectors, a freshly built index is IVF instead of exact.
IVF_THRESHOLD = 200_000


def _gpu_available() -> bool:
    try:
        return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    except Exception:  # noqa: BLE001 - a CPU-only faiss build may lack the call entirely
        return False


class VectorIndex:
    """FAISS index of unit vectors keyed by chunk id."""

    def __init__(self, dim: int, index: faiss.Index | None = None):
        self.dim = dim
        self.index = index if index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._gpu: faiss.Index | None = None
        # Ids held, mirrored in Python: faiss would happily store one id twice, and duplicate hits are wrong.
        self._ids: set[int] = set(faiss.vector_to_array(self.index.id_map).tolist())

    @classmethod
    def build(cls, dim: int, ids: np.ndarray, vecs: np.ndarray, nprobe: int = 16) -> VectorIndex:
        """A new index over ``vecs`` (``[n, dim]`` float32) with ``ids`` (``[n]`` int64)."""
        n = len(ids)
        if n < IVF_THRESHOLD:
            out = cls(dim)
        else:
            nlist = int(4 * math.sqrt(n))
            ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
            ivf.train(vecs)
            ivf.nprobe = nprobe
            out = cls(dim, faiss.IndexIDMap2(ivf))
        out.add(ids, vecs)
        return out

    @classmethod
    def load(cls, path: str | Path, dim: int) -> VectorIndex:
        """Read an index file written by :meth:`save`."""
        index = faiss.read_index(str(path))
        if index.d != dim:
            raise ValueError(f"index file {path} has vectors of size {index.d}, the store's embedder makes {dim}")
        return cls(dim, index)

    @property
    def is_flat(self) -> bool:
        """Whether this is the exact (brute-force) kind."""
        inner = faiss.downcast_index(self.index.index) if hasattr(self.index, "index") else self.index
        return isinstance(inner, faiss.IndexFlat)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> np.ndarray:
        """Chunk ids held, ``[n]`` int64."""
        return np.fromiter(self._ids, dtype=np.int64, count=len(self._ids))

    def add(self, ids: Sequence[int] | np.ndarray, vecs: np.ndarray) -> None:
        """Add vectors (``[n, dim]``) under ``ids``; ids already held are left as they are."""
        ids = np.asarray(ids, dtype=np.int64)
        new = np.array([i not in self._ids for i in ids.tolist()], dtype=bool)
        if not new.any():
            return
        self.index.add_with_ids(np.ascontiguousarray(np.asarray(vecs)[new], dtype=np.float32), ids[new])
        self._ids.update(ids[new].tolist())
        self._gpu = None

    def remove(self, ids: Sequence[int] | np.ndarray) -> None:
        """Remove vectors by id (missing ids are ignored)."""
        ids = [i for i in np.asarray(ids, dtype=np.int64).tolist() if i in self._ids]
        if not ids:
            return
        self.index.remove_ids(np.asarray(ids, dtype=np.int64))
        self._ids.difference_update(ids)
        self._gpu = None

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top ``k`` ``(chunk id, inner product)`` for one query vector ``[dim]``."""
        if len(self) == 0 or k <= 0:
            return []
        index = self.index
        if _gpu_available():
            if self._gpu is None:
                self._gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, self.index)
            index = self._gpu
        scores, ids = index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), min(k, len(self)))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def save(self, path: str | Path) -> None:
        """Write atomically: temporary file, fsync, rename, so a crash leaves the old index or the new one."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        faiss.write_index(self.index, str(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
