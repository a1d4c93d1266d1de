"""The KV store on disk: content-addressed chunk files, a SQLite manifest, a FAISS index, one writer at a time.

Layout of a store folder::

    store.json             StoreConfig: source model (name, fingerprint, KV layout), dtype, embedder, chunking
    manifest.sqlite        documents, chunks, files, checksums, embeddings, index ids (see manifest.py)
    index.faiss            inner-product index over chunk embeddings, keyed by chunk id (derived data)
    chunks/ab/<key>.safetensors   one KV chunk per file (see chunkfile.py), key = content hash
    documents/<id>.json    per-document record (path, sha256, chunk keys and offsets), for manifest rebuilds
    writer.lock            flock held by the one process writing

Chunk files are the truth: each is self-describing (source, fingerprint, layout, token ids, text, document,
offsets, checksums), so the manifest can be rebuilt by scanning them (``verify --repair``), and the index is
rebuilt from the embeddings the manifest keeps. Chunk KV is stored at position 0 (``start`` 0) with no BOS; a
store with ``chunk_prefix = "prompt"`` prefilled each chunk after the source's prompt head (``prefix_ids``) and
rotated it back to position 0.

Keys: ``sha256("mot-cag-chunk/1" | source fingerprint | int32 token ids)``, 32 hex digits, so the same
tokens under the same source model are stored once, whatever document they came from.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mot_cag.errors import StoreError
from mot_cag.models.cache import KVChunk
from mot_cag.models.layout import KVLayout
from mot_cag.store import chunkfile
from mot_cag.store.chunker import TextChunk
from mot_cag.store.embed import Embedder, make_embedder
from mot_cag.store.index import IVF_THRESHOLD, VectorIndex
from mot_cag.store.manifest import ChunkRow, DocChunk, Manifest

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
#: What a store's chunks are prefilled after (:attr:`StoreConfig.chunk_prefix`).
CHUNK_PREFIXES = ("none", "prompt")

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
    chunk_prefix: str = "none"
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
        if self.chunk_prefix not in CHUNK_PREFIXES:
            raise StoreError(f"Chunk prefix '{self.chunk_prefix}' is unknown; use one of {', '.join(CHUNK_PREFIXES)}.")
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


def _meta_checksum(meta: dict[str, str]) -> str:
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


# -------------------------------------------------------------------------------------------------- lock


class WriterLock:
    """Exclusive writer lock on a store (``flock``; released by the OS if the process dies).

    Args:
        root: Store folder.
        timeout: Seconds to wait for another writer; ``0`` fails at once, ``None`` waits forever.
        on_wait: Called once with a message when the lock is busy and we start waiting.
    """

    def __init__(self, root: Path, timeout: float | None = None, on_wait: Callable[[str], None] | None = None):
        self.root, self.timeout, self.on_wait = root, timeout, on_wait
        self.fd: int | None = None

    def __enter__(self) -> WriterLock:
        self.root.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        warned = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                os.close(self.fd)
                self.fd = None
                raise StoreError(
                    f"Another ingest is writing to store {self.root}; wait for it to finish (or stop it) and "
                    "run this ingest again."
                )
            if not warned and self.on_wait is not None:
                self.on_wait(f"another ingest is writing to {self.root}; waiting for it to finish")
                warned = True
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# -------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk.

    Attributes:
        key: Chunk key (pass to :meth:`Store.load`).
        doc: Path of the document it belongs to (the first, when the same chunk occurs in several).
        chunk_index: Its position in that document.
        score: Retrieval score (cosine similarity mixed with normalised BM25; higher is better).
        text: The chunk's text.
        path: The chunk file.
        char_start: Offset of the chunk in the document.
        char_end: End offset in the document.
        tokens: Source tokens in the chunk.
    """

    key: str
    doc: str
    chunk_index: int
    score: float
    text: str
    path: str
    char_start: int = 0
    char_end: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class WrittenChunk:
    """A chunk file on disk whose manifest row is still to be committed."""

    key: str
    file: str
    checksum: str
    tokens: int
    bytes: int
    text: str


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


# -------------------------------------------------------------------------------------------------- store


class Store:
    """A KV store folder. Open with :meth:`open` (read) or :meth:`open_for_write` (inside a writer lock).

    Reading is safe while another process writes: SQLite WAL gives readers a consistent snapshot and every
    file is replaced atomically.
    """

    def __init__(self, root: Path, config: StoreConfig, manifest: Manifest, embedder: Embedder | None = None):
        self.root = root
        self.config = config
        self.manifest = manifest
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
        if not mpath.is_file() and any((root / CHUNKS_DIR).glob("*/*.safetensors")):
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
        """Close the manifest."""
        self.manifest.close()

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
        return self.root / chunk_relpath(key)

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
        path = f"{self.root}/{chunk_relpath(key)}"  # a string: building a Path costs more than the stat
        try:
            tensors, meta = chunkfile.read_chunk_tensors(path, None if verify else chunkfile.KV_TENSORS)
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
            ids, text, meta = chunkfile.read_content(path)
            start = int(meta["start"])
        except chunkfile.ChunkFileMissing:
            raise StoreError(f"Chunk {key} is not in store {self.root} (file {path} missing); run "
                             f"`mot-cag store verify --store {self.root}`.") from None
        except (KeyError, ValueError) as e:
            raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify --store {self.root}`.") \
                from None
        return ChunkInfo(key, text, ids, start, str(path), meta)

    def token_ids(self, key: str) -> list[int]:
        """Source token ids of chunk ``key`` (no special tokens)."""
        return self.chunk_info(key).token_ids

    # -------------------------------------------------------------------------------------- retrieval

    @property
    def index(self) -> VectorIndex:
        """The vector index, loaded from disk and kept in line with the manifest (in memory).

        A long-lived reader sees chunks another process ingests after it opened the store: when the manifest's
        chunk count or newest id changes, the in-memory index is brought up to date first.
        """
        with self._index_lock:
            state = self.manifest.chunk_state()
            if self._index is None or state != self._index_state:
                self.sync_index(write=False)
                self._index_state = state
            assert self._index is not None
            return self._index

    def _load_index(self) -> VectorIndex:
        path = self.root / INDEX_FILE
        if path.is_file():
            try:
                return VectorIndex.load(path, self.config.embed_dim)
            except Exception:  # noqa: BLE001 - a damaged index is derived data: rebuild it below
                pass
        return VectorIndex(self.config.embed_dim)

    def sync_index(self, write: bool) -> tuple[int, int]:
        """Make the index hold exactly the manifest's chunks.

        Chunks without a stored embedding (an ingest killed between the file and its embedding) are
        embedded now; with ``write`` their embeddings are saved to the manifest too.

        Returns:
            ``(added, removed)`` vector counts.
        """
        with self._index_lock:
            return self._sync_index(write)

    def _sync_index(self, write: bool) -> tuple[int, int]:
        index = self._index if self._index is not None else self._load_index()
        self._index = index
        pending = self.manifest.missing_embeddings()
        pending_vecs = self.embedder.encode([t for _, t in pending]) if pending else None
        if pending and write:
            with self.manifest.transaction():
                self.manifest.set_embeddings([i for i, _ in pending], pending_vecs)
        have = set(index.ids().tolist())
        rows = self.manifest.chunk_ids()
        extra = sorted(have - rows)
        index.remove(extra)
        missing = sorted(rows - have)
        ids, vecs = self.manifest.embeddings(self.config.embed_dim, ids=missing)
        index.add(ids, vecs)
        added = len(ids)
        if pending and not write:
            # Read-only: embeddings computed for this process only, the manifest is left untouched.
            todo = [n for n, (i, _) in enumerate(pending) if i in set(missing) - set(ids.tolist())]
            index.add([pending[n][0] for n in todo], pending_vecs[todo])
            added += len(todo)
        return added, len(extra)

    def save_index(self) -> None:
        """Write the index atomically (call while holding the writer lock).

        An exact index that has grown past :data:`~mot_cag.store.index.IVF_THRESHOLD` vectors is rebuilt as IVF
        from the manifest's embeddings first.
        """
        index = self.index
        if index.is_flat and len(index) >= IVF_THRESHOLD:
            ids, vecs = self.manifest.embeddings(self.config.embed_dim)
            self._index = index = VectorIndex.build(self.config.embed_dim, ids, vecs)
        index.save(self.root / INDEX_FILE)

    def search(self, query: str, k: int = 4, lexical_weight: float = 0.3) -> list[Hit]:
        """The ``k`` chunks most relevant to ``query``.

        Dense cosine similarity over the FAISS index is mixed with BM25 (normalised by the best BM25 score of
        the query): ``score = (1 - w) * cosine + w * bm25 / max_bm25``. Candidates come from both signals.
        Only chunks of completely ingested documents are returned.

        Args:
            query: Question or search text.
            k: Number of chunks.
            lexical_weight: ``w`` above; 0 uses embeddings only.
        """
        if k <= 0 or not query.strip():
            return []
        pool = max(4 * k, 32)
        qvec = self.embedder.encode([query])[0]
        with self._index_lock:  # another thread may be bringing the index up to date
            dense = dict(self.index.search(qvec, pool))
        lexical: dict[int, float] = {}
        if lexical_weight > 0:
            top = sorted(self.manifest.lexical_scores(query, pool).items(), key=lambda kv: -kv[1])
            best = top[0][1] if top else 0.0
            lexical = {i: s / best for i, s in top} if best > 0 else {}
        cand = set(dense) | set(lexical)
        missing = [i for i in cand if i not in dense]
        if missing:
            ids, vecs = self.manifest.embeddings(self.config.embed_dim, ids=missing)
            dense.update({int(i): float(v @ qvec) for i, v in zip(ids, vecs, strict=True)})
        scored = sorted(((1 - lexical_weight) * dense.get(i, 0.0) + lexical_weight * lexical.get(i, 0.0), i)
                        for i in cand)
        rows = self.manifest.chunks_by_id(cand)
        hits: list[Hit] = []
        for score, cid in reversed(scored):
            row = rows.get(cid)
            places = self.manifest.places(row.key) if row is not None else []
            if not places:
                continue  # chunk of a document whose ingest has not completed
            doc, place = places[0]
            hits.append(Hit(row.key, doc, place.index, float(score), row.text, str(self.root / row.file),
                            place.char_start, place.char_end, row.tokens))
            if len(hits) == k:
                break
        return hits

    # ---------------------------------------------------------------------------------------- writing

    def has_chunk(self, key: str) -> bool:
        """Whether the manifest has chunk ``key``."""
        return self.manifest.chunk(key) is not None

    def put_chunk(self, kv: KVChunk, chunk: TextChunk, doc: str, key: str) -> ChunkRow:
        """Write a chunk file atomically, then commit its manifest row.

        Raises:
            StoreError: The disk is full (or another write error); nothing committed is affected.
        """
        written = self.write_chunk_file(kv, chunk, doc, key)
        return self.commit_chunk(written)

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
        rel = chunk_relpath(key)
        # Token ids and text go in tensors (chunk format 2), not in the metadata that every load parses.
        meta = {
            "key": key, "source": self.source.name, "fingerprint": self.source.fingerprint, "doc": doc,
            "chunk_index": str(chunk.index), "char_start": str(chunk.char_start), "char_end": str(chunk.char_end),
            "special_tokens": "none",
        }
        if self.config.prefix_ids:
            meta["prefix"] = prefix_digest(self.config.prefix_ids)
        meta["meta_checksum"] = _meta_checksum(meta)
        path = self.root / rel
        try:
            data, written = chunkfile.encode_chunk(kv, self.source.layout, self.config.torch_dtype, meta,
                                                   token_ids=chunk.token_ids, text=chunk.text)
            chunkfile.write_atomic(path, data, durable=durable)
            nbytes = len(data)
        except OSError as e:
            for tmp in path.parent.glob(f".{path.name}.*.tmp"):
                tmp.unlink(missing_ok=True)
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
        path = self.file(key)
        prefix = self.config.prefix_ids
        if not path.is_file() or check_chunk_file(path, key, self.source, prefix_ids=prefix) is not None:
            return None
        _, text, meta = chunkfile.read_content(path)
        with self.manifest.transaction():
            self.manifest.add_chunk(key, chunk_relpath(key), meta["checksum"], int(meta["tokens"]),
                                    path.stat().st_size, text)
        return self.manifest.chunk(key)

    def remove_temp_files(self) -> int:
        """Delete temporary files of interrupted writes. Only the writer-lock holder may call this: any
        temporary file it sees belongs to a writer that died."""
        n = 0
        for pattern in (f"{CHUNKS_DIR}/*/.*.tmp", f"{DOCS_DIR}/.*.tmp", ".*.tmp"):
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

    def put_document(self, path: str, sha256: str, size: int, mtime_ns: int, chunks: list[DocChunk],
                     tokens: int, write_record: bool = True) -> int:
        """Commit a complete document, write its record, and delete chunks only its old version used.

        Args:
            path: Document path (absolute).
            sha256: Hash of the content that was chunked.
            size: File size.
            mtime_ns: File modification time.
            chunks: Its chunks in order.
            tokens: Source tokens over all its chunks.
            write_record: Write ``documents/<id>.json`` now; pass ``False`` to write it yourself with
                :meth:`write_document_record` (e.g. on a writer thread).

        Returns:
            Number of chunks removed.
        """
        with self.manifest.transaction():
            old_keys = self.manifest.put_document(path, sha256, size, mtime_ns, chunks, tokens)
        if write_record:
            self.write_document_record(path, sha256, size, mtime_ns, chunks, tokens)
        return self.collect(set(old_keys) - {c.key for c in chunks})

    def write_document_record(self, path: str, sha256: str, size: int, mtime_ns: int, chunks: list[DocChunk],
                              tokens: int, durable: bool = True) -> Path:
        """Write a document's JSON record atomically (what :func:`rebuild_manifest` restores documents from).

        With ``durable=False`` it becomes durable at the next :meth:`sync_files`.
        """
        record = self.document_record(path)
        data = json.dumps({"path": path, "sha256": sha256, "size": size, "mtime_ns": mtime_ns, "tokens": tokens,
                           "chunks": [asdict(c) for c in chunks]}, indent=1, sort_keys=True).encode()
        chunkfile.write_atomic(record, data, durable=durable)
        return record

    def document_record(self, path: str) -> Path:
        """Where the JSON record of document ``path`` lives (what :func:`rebuild_manifest` reads)."""
        return self.root / DOCS_DIR / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"

    def collect(self, keys: Iterable[str]) -> int:
        """Delete those of ``keys`` that no document uses: manifest rows first, then files, then vectors."""
        with self.manifest.transaction():
            gone = self.manifest.delete_chunks(self.manifest.unreferenced(keys))
        for row in gone:
            (self.root / row.file).unlink(missing_ok=True)
        if gone and self._index is not None:
            self._index.remove([r.id for r in gone])
        return len(gone)

    # -------------------------------------------------------------------------------------------- verify

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
        bad: list[str] = []
        for n, row in enumerate(rows, 1):
            path = self.root / row.file
            reason = "file missing" if not path.is_file() else check_chunk_file(
                path, row.key, self.source, row.checksum, self.config.prefix_ids)
            if reason is not None:
                bad.append(row.key)
                report.problems.append(Problem("missing" if reason == "file missing" else "damaged", row.key,
                                               f"{path}: {reason}"))
            report.chunks_checked = n
            if progress is not None:
                progress(n, len(rows))
        known = {r.key for r in rows}
        for f in sorted((self.root / CHUNKS_DIR).glob("*/*")):
            if f.name.endswith(".tmp"):
                report.notes.append(Problem("temp", str(f), "leftover temporary file of an interrupted write"))
            elif f.suffix == ".safetensors" and f.stem not in known:
                report.notes.append(Problem("orphan", f.stem, f"{f}: chunk file with no manifest row (an "
                                                              "interrupted ingest; the next ingest adopts it)"))
        index_path = self.root / INDEX_FILE
        try:
            on_disk = set(VectorIndex.load(index_path, self.config.embed_dim).ids().tolist()) \
                if index_path.is_file() else set()
        except Exception as e:  # noqa: BLE001
            on_disk = set()
            report.notes.append(Problem("index", str(index_path), f"unreadable ({e}); rebuilt on open"))
        ids = {r.id for r in rows}
        if on_disk != ids:
            report.notes.append(Problem(
                "index", str(index_path), f"index holds {len(on_disk & ids)} of {len(ids)} chunks and "
                f"{len(on_disk - ids)} stale ids; brought up to date on open, saved by the next ingest or --repair"))
        if repair:
            self._repair(report, bad)
        return report

    def _repair(self, report: VerifyReport, bad: list[str]) -> None:
        if bad:
            with self.manifest.transaction():
                docs = {p for k in bad for p, _ in self.manifest.places(k)}
                for d in docs:
                    self.manifest.delete_document(d)
                self.manifest.delete_chunks(bad)
            for k in bad:
                self.file(k).unlink(missing_ok=True)
            for p in report.problems:
                if p.kind in ("damaged", "missing"):
                    p.fixed = True
                    p.detail += "; removed: run the same ingest again to recreate it"
        for note in report.notes:
            if note.kind == "temp":
                Path(note.subject).unlink(missing_ok=True)
                note.fixed = True
            elif note.kind == "orphan":
                note.fixed = self.adopt_chunk(note.subject) is not None
                if not note.fixed:
                    self.file(note.subject).unlink(missing_ok=True)
                    note.fixed = True
        self._index = None
        self.sync_index(write=True)
        self.save_index()
        for note in report.notes:
            if note.kind == "index":
                note.fixed = True


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
    if meta.get("key") != key:
        return f"holds chunk {meta.get('key')!r}, expected {key}"
    if meta.get("meta_checksum") != _meta_checksum(meta):
        return "metadata fails its checksum"
    try:
        ids = chunkfile.chunk_token_ids(tensors, meta)
    except StoreError:
        return "token ids unreadable"
    if meta.get("fingerprint") != source.fingerprint:
        return f"made by another source model (fingerprint {meta.get('fingerprint')})"
    prefix_ids = list(prefix_ids)
    if meta.get("prefix", "") != (prefix_digest(prefix_ids) if prefix_ids else ""):
        return f"prefilled after another prefix ({meta.get('prefix') or 'none'}) than this store's"
    if chunk_key(source.fingerprint, ids, prefix_ids) != key:
        return "token ids do not hash to the chunk key"
    if meta.get("start") != "0":
        return f"prefilled at position {meta.get('start')}, store chunks are prefilled at 0"
    lay = source.layout
    want = [lay.layers, lay.kv_heads, len(ids), lay.head_dim]
    try:
        shapes = [json.loads(meta.get("shape", "[]"))] + [list(tensors[n].shape) for n in chunkfile.KV_TENSORS]
    except json.JSONDecodeError:
        return f"shape {meta.get('shape')!r} unreadable"
    except KeyError as e:
        return f"tensor {e} missing"
    if any(s != want for s in shapes):
        return f"shape {meta.get('shape')} does not fit the source layout {want}"
    if chunkfile.chunk_checksum(tensors) != meta.get("checksum"):
        return "tensor data fails its checksum"
    try:
        chunkfile.chunk_text(tensors, meta)
    except StoreError as e:
        return f"text unreadable ({e})"
    if row_checksum is not None and row_checksum != meta["checksum"]:
        return "checksum differs from the manifest's"
    return None


# ------------------------------------------------------------------------------------------- repair


def rebuild_manifest(root: str | Path, config: StoreConfig | None = None) -> tuple[Store, list[Problem]]:
    """Rebuild a store's manifest from its chunk files and document records (call under the writer lock).

    The old manifest (if any) is kept beside it as ``manifest.sqlite.damaged-<time>``. Chunk files that fail
    :func:`check_chunk_file` are deleted and reported; a document is restored when all its chunks are.

    Returns:
        The reopened store and the problems found while scanning.
    """
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
    for f in sorted((root / CHUNKS_DIR).glob("*/*.safetensors")):
        reason = check_chunk_file(f, f.stem, config.source, prefix_ids=config.prefix_ids)
        if reason is not None:
            f.unlink(missing_ok=True)
            problems.append(Problem("damaged", f.stem, f"{f}: {reason}; removed", fixed=True))
            continue
        _, text, meta = chunkfile.read_content(f)
        with st.manifest.transaction():
            st.manifest.add_chunk(f.stem, chunk_relpath(f.stem), meta["checksum"], int(meta["tokens"]),
                                  f.stat().st_size, text)
    for rec_path in sorted((root / DOCS_DIR).glob("*.json")):
        try:
            rec = json.loads(rec_path.read_text(encoding="utf-8"))
            chunks = [DocChunk(c["index"], c["key"], c["char_start"], c["char_end"]) for c in rec["chunks"]]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            problems.append(Problem("manifest", str(rec_path), f"document record unreadable ({e}); skipped"))
            continue
        if all(st.has_chunk(c.key) for c in chunks):
            with st.manifest.transaction():
                st.manifest.put_document(rec["path"], rec["sha256"], rec["size"], rec["mtime_ns"], chunks,
                                         rec["tokens"])
        else:
            problems.append(Problem("missing", rec["path"], "document lost chunks; re-ingest it", fixed=True))
    st.sync_index(write=True)
    st.save_index()
    return st, problems


def verify_store(path: str | Path = DEFAULT_STORE, repair: bool = False,
                 progress: Callable[[int, int], None] | None = None, lock_timeout: float | None = 0) -> VerifyReport:
    """Verify the store at ``path`` (see :meth:`Store.verify`), rebuilding a damaged manifest with ``repair``.

    Raises:
        StoreError: No store at ``path``; with ``repair``, another writer holds the store.
    """
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
