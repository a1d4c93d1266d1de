"""What a store is on disk: its folder layout, its ``store.json`` (:class:`StoreConfig`), chunk keys and paths.

Layout of a store folder::

    store.json             StoreConfig: source model (name, fingerprint, KV layout), dtype, embedder, chunking
    manifest.sqlite        documents, chunks, files, checksums, embeddings, index ids (see manifest.py)
    index.faiss            inner-product index over chunk embeddings, keyed by chunk id (derived data)
    chunks/ab/<key>.safetensors   one KV chunk per file (see chunkfile.py), key = content hash
    documents/<id>.json    per-document record (path, sha256, chunk keys and offsets), for manifest rebuilds
    writer.lock            flock held by the one process writing (lock.py)

Chunk files are the truth: each is self-describing (source, fingerprint, layout, token ids, text, document,
offsets, checksums), so the manifest can be rebuilt by scanning them (``verify --repair``), and the index is
rebuilt from the embeddings the manifest keeps. Chunk KV is stored at position 0 (``start`` 0) with no BOS; a
store with ``chunk_prefix = "prompt"`` prefilled each chunk after the source's prompt head (``prefix_ids``) and
rotated it back to position 0.

Keys: ``sha256("mot-cag-chunk/1" | source fingerprint | int32 token ids)``, 32 hex digits, so the same
tokens under the same source model are stored once, whatever document they came from.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mot_cag.errors import StoreError
from mot_cag.models.layout import KVLayout
from mot_cag.names import STORED_CHUNK_PREFIXES, StoredChunkPrefix, choose

STORE_FORMAT = "mot-cag-store/1"
#: Format of a store whose chunks were prefilled after a prefix: versions that know only format 1 refuse it
#: instead of reading its chunks as prefix-free (their keys would not verify and a repair would delete them).
STORE_FORMAT_PREFIXED = "mot-cag-store/2"
READ_STORE_FORMATS = (STORE_FORMAT, STORE_FORMAT_PREFIXED)
CONFIG_FILE = "store.json"
MANIFEST_FILE = "manifest.sqlite"
INDEX_FILE = "index.faiss"
CHUNKS_DIR = "chunks"
DOCS_DIR = "documents"
LOCK_FILE = "writer.lock"
DEFAULT_STORE = "stores/default"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: Chunk-file metadata fields covered by ``meta_checksum`` (a field absent counts as ``""``). ``token_ids`` and
#: ``text`` are metadata only in chunk format 1; format 2 stores them as tensors, covered by the tensor checksum
#: (:func:`~mot_cag.store.chunkfile.chunk_checksum`) with the KV.
_META_FIELDS = ("key", "source", "fingerprint", "token_ids", "text", "doc", "chunk_index", "char_start",
                "char_end", "special_tokens")


# ------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class StoreSource:
    """The source model a store was made with.

    Attributes:
        name: Model name as given at creation (zoo name, alias, path...).
        fingerprint: :func:`mot_cag.models.registry.fingerprint` of its weights and tokenizer.
        layout: Its KV layout.
    """

    name: str
    fingerprint: str
    layout: KVLayout


@dataclass(frozen=True)
class StoreConfig:
    """What a store is; written once to ``store.json`` when the store is created.

    Attributes:
        source: Source model identity.
        dtype: Stored KV dtype (``float16``, ``bfloat16``, ``float32``).
        embedder: Embedder name (see :func:`mot_cag.store.embed.make_embedder`).
        embed_dim: Embedding size.
        chunk_tokens: Default chunk size in source tokens.
        format: Store format version.
        chunk_prefix: What every chunk was prefilled after: ``none`` (alone, from position 0) or ``prompt``
            (after the source model's prompt head, :attr:`prefix_ids`, whose own KV is not stored: a chunk then
            looks as it will be read, after that head). A store's prefix never changes; another prefix is
            another store.
        prefix_ids: The source token ids of that prefix (empty for ``none``).
    """

    source: StoreSource
    dtype: str = "float16"
    embedder: str = "all-MiniLM-L6-v2"
    embed_dim: int = 384
    chunk_tokens: int = 256
    format: str = STORE_FORMAT
    chunk_prefix: StoredChunkPrefix = "none"
    prefix_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise StoreError(f"KV dtype '{self.dtype}' is not supported; use one of {', '.join(DTYPES)}.")
        if self.chunk_tokens < 8:
            raise StoreError(f"Chunks of {self.chunk_tokens} tokens are too small; use --chunk-tokens 8 or more.")
        try:
            object.__setattr__(self, "prefix_ids", tuple(int(i) for i in self.prefix_ids))
        except (TypeError, ValueError):
            raise StoreError(f"The store's prefix_ids {self.prefix_ids!r} are not token ids; the store.json is "
                             "damaged: restore it or ingest into a new store.") from None
        object.__setattr__(self, "format", STORE_FORMAT_PREFIXED if self.prefix_ids else STORE_FORMAT)
        choose("chunk prefix", self.chunk_prefix, STORED_CHUNK_PREFIXES, StoreError)
        if (self.chunk_prefix == "none") != (not self.prefix_ids):
            raise StoreError(f"Chunk prefix '{self.chunk_prefix}' with {len(self.prefix_ids)} prefix tokens is "
                             "inconsistent: 'none' has no tokens, 'prompt' needs them.")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype."""
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        """JSON form."""
        d = asdict(self)
        d["source"]["layout"] = self.source.layout.to_dict()
        d["prefix_ids"] = list(self.prefix_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StoreConfig:
        """Inverse of :meth:`to_dict`; unknown keys from newer versions are ignored."""
        src = d["source"]
        source = StoreSource(src["name"], src["fingerprint"], KVLayout.from_dict(src["layout"]))
        names = set(cls.__dataclass_fields__) - {"source"}
        return cls(source=source, **{k: v for k, v in d.items() if k in names})


def chunk_key(fingerprint: str, token_ids: Iterable[int], prefix_ids: Iterable[int] = ()) -> str:
    """Content address of a chunk: hash of the source model identity, the chunk's token ids and, when the chunk
    was prefilled after a prefix, that prefix's ids (the same tokens after another prefix are other KV)."""
    h = hashlib.sha256(b"mot-cag-chunk/1\0")
    h.update(fingerprint.encode() + b"\0")
    h.update(np.asarray(list(token_ids), dtype="<i4").tobytes())
    prefix = list(prefix_ids)
    if prefix:  # absent for prefix-free chunks, so their keys are those of earlier stores
        h.update(b"\0prefix\0" + np.asarray(prefix, dtype="<i4").tobytes())
    return h.hexdigest()[:32]


def chunk_relpath(key: str) -> str:
    """Where chunk ``key`` lives, relative to the store (256 sub-folders keep directories small)."""
    return f"{CHUNKS_DIR}/{key[:2]}/{key}.safetensors"


def meta_checksum(meta: dict[str, str]) -> str:
    """Checksum of a chunk file's identifying metadata (the fields of ``_META_FIELDS``, and its prefix)."""
    fields = {k: meta.get(k, "") for k in _META_FIELDS}
    if "prefix" in meta:  # only chunks prefilled after a prefix carry it: older files keep their checksum
        fields["prefix"] = meta["prefix"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def prefix_digest(prefix_ids: Iterable[int]) -> str:
    """What a chunk file records of the prefix it was prefilled after: its length and a hash of its ids."""
    ids = list(prefix_ids)
    return f"{len(ids)}:{hashlib.sha256(np.asarray(ids, dtype='<i4').tobytes()).hexdigest()[:16]}"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary file, fsync, rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class TextChunk:
    """One chunk of a document.

    Attributes:
        index: Position of the chunk in its document (0, 1, ...).
        text: The chunk's text, ``document[char_start:char_end]``.
        char_start: Offset of the first character in the document.
        char_end: Offset just past the last character.
        token_ids: Source-model token ids of ``text`` without special tokens.
        last: Whether this is the document's final chunk.
    """

    index: int
    text: str
    char_start: int
    char_end: int
    token_ids: tuple[int, ...]
    last: bool = False
