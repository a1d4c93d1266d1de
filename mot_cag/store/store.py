"""The KV store: one folder (its layout in format.py) read through :class:`Store`.

:class:`Store` opens a store and reads chunks; its other verbs live beside it, one concept per module:
``search.py`` (index and hybrid search), ``writing.py`` (chunk files, rows, records), ``verify.py`` (checks
and repair), ``manage.py`` (ls / rm / gc), ``lock.py`` (the writer lock).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from mot_cag.errors import StoreError
from mot_cag.models.cache import KVChunk
from mot_cag.store import chunkfile
from mot_cag.store.backend import DiskChunks, disk_has_chunks
from mot_cag.store.embed import Embedder, make_embedder
from mot_cag.store.format import (
    CONFIG_FILE,
    DEFAULT_STORE,
    MANIFEST_FILE,
    READ_STORE_FORMATS,
    StoreConfig,
    StoreSource,
    chunk_relpath,
    write_json_atomic,
)
from mot_cag.store.index import VectorIndex
from mot_cag.store.manifest import Manifest
from mot_cag.store.search import Searching
from mot_cag.store.verify import Verifying
from mot_cag.store.writing import Writing


@dataclass(frozen=True)
class ChunkInfo:
    """A stored chunk's identity and source-side content (what translators need besides the KV).

    Attributes:
        key: Chunk key.
        text: Its text.
        token_ids: Its source token ids (no special tokens).
        start: Position it was prefilled at (0 in a store).
        path: The chunk file.
        meta: The file's safetensors metadata (chunk format 2 keeps the token ids and text out of it).
    """

    key: str
    text: str
    token_ids: list[int]
    start: int
    path: str
    meta: dict[str, str]



class Store(Searching, Writing, Verifying):
    """A KV store folder. Open with :meth:`open` (read) or :meth:`open_for_write` (inside a writer lock).

    Reading is safe while another process writes: SQLite WAL gives readers a consistent snapshot and every
    file is replaced atomically.
    """

    def __init__(self, root: Path, config: StoreConfig, manifest: Manifest, embedder: Embedder | None = None):
        self.root = root
        self.config = config
        self.manifest = manifest
        self.chunks: DiskChunks = DiskChunks(root)  # the chunk files (store/backend.py)
        self._embedder = embedder
        self._index: VectorIndex | None = None
        self._index_state: tuple[int, int] | None = None
        self._index_lock = threading.RLock()

    # ---------------------------------------------------------------------------------------- opening

    @staticmethod
    def exists(path: str | Path) -> bool:
        """Whether ``path`` holds a store."""
        return (Path(path) / CONFIG_FILE).is_file()

    @staticmethod
    def read_config(path: str | Path) -> StoreConfig:
        """The config of the store at ``path``.

        Raises:
            StoreError: No store there, or its ``store.json`` is unreadable.
        """
        root = Path(path)
        cfg = root / CONFIG_FILE
        if not cfg.is_file():
            raise StoreError(f"No store at {root}: create one with `mot-cag ingest DOCS --store {root}`.")
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"Store config {cfg} is unreadable ({e}); restore it or re-ingest into a new store.") \
                from None
        if data.get("format") not in READ_STORE_FORMATS:
            raise StoreError(f"{root} is a store of format {data.get('format')!r}; this mot-cag reads "
                             f"{', '.join(READ_STORE_FORMATS)}.")
        return StoreConfig.from_dict(data)

    @classmethod
    def open(cls, path: str | Path = DEFAULT_STORE, embedder: Embedder | None = None) -> Store:
        """Open an existing store for reading (search, load, info, verify).

        Raises:
            StoreError: No store at ``path``, or its manifest is missing while chunk files exist.
        """
        root = Path(path)
        config = cls.read_config(root)
        mpath = root / MANIFEST_FILE
        if not mpath.is_file() and disk_has_chunks(root):
            raise StoreError(f"Store {root} has chunk files but no manifest; rebuild it with "
                             f"`mot-cag store verify --repair --store {root}`.")
        try:
            manifest = Manifest(mpath)
        except Exception as e:  # noqa: BLE001 - sqlite raises DatabaseError for a damaged file
            raise StoreError(f"The manifest of store {root} is damaged ({e}); rebuild it with "
                             f"`mot-cag store verify --repair --store {root}`.") from None
        return cls(root, config, manifest, embedder)

    @classmethod
    def open_for_write(cls, path: str | Path, config: StoreConfig, embedder: Embedder | None = None) -> Store:
        """Open the store at ``path`` for writing, creating it with ``config`` when absent.

        Call inside a :class:`WriterLock`. An existing store must have the same source model (fingerprint),
        embedder and dtype.

        Raises:
            StoreError: The store was made by another source model, embedder or dtype.
        """
        root = Path(path)
        if not cls.exists(root):
            root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(root / CONFIG_FILE, config.to_dict())
            chunkfile._fsync_dir(root)
            return cls.open(root, embedder)
        have = cls.read_config(root)
        if have.source.fingerprint != config.source.fingerprint:
            raise StoreError(
                f"Store {root} holds KV caches of source model '{have.source.name}' (fingerprint "
                f"{have.source.fingerprint}), not '{config.source.name}' ({config.source.fingerprint}); ingest with "
                f"--source {have.source.name}, or use another --store."
            )
        if have.embedder != config.embedder:
            raise StoreError(f"Store {root} is indexed with embedder '{have.embedder}', not '{config.embedder}'; "
                             f"ingest with --embedder {have.embedder}, or use another --store.")
        if have.dtype != config.dtype:
            raise StoreError(f"Store {root} keeps KV in {have.dtype}, not {config.dtype}; ingest with "
                             f"--dtype {have.dtype}, or use another --store.")
        return cls.open(root, embedder)

    def close(self) -> None:
        """Close the manifest and the chunk backend."""
        self.manifest.close()
        self.chunks.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- basics

    @property
    def source(self) -> StoreSource:
        """Source model name, fingerprint and KV layout."""
        return self.config.source

    @property
    def embedder(self) -> Embedder:
        """The store's embedder (loaded on first use)."""
        if self._embedder is None:
            self._embedder = make_embedder(self.config.embedder)
        if self._embedder.name != self.config.embedder or self._embedder.dim != self.config.embed_dim:
            raise StoreError(f"Store {self.root} is indexed with embedder '{self.config.embedder}' "
                             f"({self.config.embed_dim}-d), not '{self._embedder.name}' ({self._embedder.dim}-d).")
        return self._embedder

    def file(self, key: str) -> Path:
        """Absolute path of chunk ``key``'s file."""
        return self.chunks.path(key)

    def info(self) -> dict:
        """Totals for ``mot-cag store info --json``: documents, chunks, tokens, bytes, source, bytes_per_token.

        ``bytes`` counts chunk files (the KV itself); ``tokens`` counts each stored chunk once.
        """
        t = self.manifest.totals()
        return {
            "documents": t["documents"], "chunks": t["chunks"], "tokens": t["tokens"], "bytes": t["bytes"],
            "source": self.source.name,
            "bytes_per_token": round(t["bytes"] / t["tokens"], 2) if t["tokens"] else 0.0,
            "fingerprint": self.source.fingerprint, "dtype": self.config.dtype,
            "embedder": self.config.embedder, "store": str(self.root),
            "chunk_prefix": self.config.chunk_prefix, "prefix_tokens": len(self.config.prefix_ids),
        }

    # ---------------------------------------------------------------------------------------- reading

    def load(self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
             verify: bool = False) -> KVChunk:
        """The KV of chunk ``key``, prefilled at position 0: keys/values ``[layers, kv_heads, seq, head_dim]``.

        The tensors are views of a private memory map of the file
        (:func:`~mot_cag.store.chunkfile.read_chunk_tensors`): nothing is copied until they are used (or moved to
        ``device`` / cast to ``dtype``), and the token ids and text in the file are not decoded. ``verify``
        hashes the file's tensors (KV, token ids, text) against its checksum first.

        Args:
            key: Chunk key from :meth:`search`.
            device: Where the tensors go.
            dtype: Cast to this dtype (``None`` keeps the stored one, fp16 by default).
            verify: Recompute the checksum first; a damaged file raises instead of returning garbage.

        Raises:
            StoreError: Unknown key, missing or damaged file.
        """
        path = f"{self.root}/{chunk_relpath(key)}"  # for messages
        try:
            tensors, meta = self.chunks.get(key, None if verify else chunkfile.KV_TENSORS)
        except chunkfile.ChunkFileMissing:
            raise StoreError(f"Chunk {key} is not in store {self.root} (file {path} missing); run "
                             f"`mot-cag store verify --store {self.root}`.") from None
        try:
            if verify and chunkfile.chunk_checksum(tensors) != meta.get("checksum"):
                raise StoreError(f"Chunk file {path} fails its checksum; run `mot-cag store verify --store "
                                 f"{self.root}` and re-ingest.")
            chunk = KVChunk(tensors["keys"], tensors["values"], int(meta["start"]))
        except (KeyError, ValueError) as e:
            raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify --store {self.root}`.") \
                from None
        if dtype is not None or (device != "cpu" and torch.device(device).type != "cpu"):
            chunk = chunk.to(device=device, dtype=dtype)
        return chunk

    def chunk_info(self, key: str) -> ChunkInfo:
        """Text, token ids and metadata of chunk ``key`` (the KV is not read).

        Raises:
            StoreError: Missing or damaged file.
        """
        path = self.file(key)
        try:
            ids, text, meta = self.chunks.content(key)
            start = int(meta["start"])
        except chunkfile.ChunkFileMissing:
            raise StoreError(f"Chunk {key} is not in store {self.root} (file {path} missing); run "
                             f"`mot-cag store verify --store {self.root}`.") from None
        except (KeyError, ValueError) as e:
            raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify --store {self.root}`.") \
                from None
        return ChunkInfo(key, text, ids, start, str(path), meta)
