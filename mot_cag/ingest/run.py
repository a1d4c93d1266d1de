"""Ingest: documents -> chunks (source tokens) -> source prefill -> KV chunk files + manifest + index.

Crash safety comes from the order of writes, not from one big transaction:

1. each chunk file is written to a temporary name and renamed into place;
2. a batch of files is made durable by one filesystem sync (group commit, see :class:`_Run`), and only
   then are their manifest rows committed;
3. a document row (with its chunk list) is committed only after all its chunks' rows;
4. the index is saved atomically at the end, every ``index_save_every_s`` seconds, and on Ctrl-C.

Killed anywhere, the store still opens and verifies: a file without a row is adopted by the next run (no
prefill), a row without an embedding is embedded on the next open, a document without a row is read again
and finds its finished chunks already there. One writer at a time (:class:`~mot_cag.store.lock.WriterLock`);
a second ingest waits for the first.

Unchanged files (same size and mtime, or same sha256) are skipped without tokenizing; a changed file gets a
fresh chunk list, and chunks only its old version used are deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from mot_cag.config import PipelineConfig
from mot_cag.errors import StoreError
from mot_cag.ingest.chunker import Chunker
from mot_cag.ingest.documents import SkippedFile, SourceFile, discover, file_sha256, read_blocks
from mot_cag.models.cache import KVChunk, prefill, prefill_after
from mot_cag.models.positions import Positioner
from mot_cag.store.embed import canonical_name, make_embedder
from mot_cag.store.format import DEFAULT_STORE, LOCK_FILE, StoreConfig, StoreSource, chunk_key
from mot_cag.store.lock import WriterLock
from mot_cag.store.manifest import DocChunk, DocumentVersion
from mot_cag.store.store import Store
from mot_cag.store.writing import WrittenChunk

if TYPE_CHECKING:
    from mot_cag.models.registry import LoadedModel

#: Source model of a new store when neither the caller nor a pipeline names one.
DEFAULT_SOURCE = PipelineConfig.source


class IngestProgress(Protocol):
    """Receives progress events (the CLI draws a rich progress bar from them)."""

    def begin(self, files: int) -> None:
        """Ingest starts over ``files`` files."""

    def update(self, files_done: int, chunks: int, tokens: int) -> None:
        """Totals so far: files finished, chunks handled (added or skipped), source tokens."""

    def note(self, message: str) -> None:
        """Something the user should know (waiting for a lock, a skipped file)."""


@dataclass
class IngestResult:
    """What an ingest did; :meth:`to_json` is the ``mot-cag ingest --json`` record.

    Attributes:
        store: Store folder.
        source: The store's source model name.
        documents: Documents of this run now in the store (changed, new and unchanged).
        documents_unchanged: Of those, skipped because their content had not changed.
        chunks_added: Chunk files written (prefilled) by this run.
        chunks_skipped: Chunks of this run's documents already stored (unchanged documents, repeated text).
        chunks_removed: Chunks deleted because only an old version of a changed document, or a removed
            document, used them.
        documents_removed: Documents removed because their file is gone from an ingested folder (sync).
        tokens: Source tokens over the chunks of this run's documents (repeats counted per occurrence).
        seconds: Wall time.
        skipped_files: Files not ingested and why.
    """

    store: str
    source: str
    documents: int = 0
    documents_unchanged: int = 0
    chunks_added: int = 0
    chunks_skipped: int = 0
    chunks_removed: int = 0
    documents_removed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    skipped_files: list[SkippedFile] = field(default_factory=list)

    def to_json(self) -> dict:
        """The cli.md keys, plus ``documents_unchanged``, ``chunks_removed``, ``documents_removed`` and
        ``skipped_files``."""
        return {
            "documents": self.documents, "chunks_added": self.chunks_added, "chunks_skipped": self.chunks_skipped,
            "tokens": self.tokens, "store": self.store, "source": self.source, "seconds": round(self.seconds, 3),
            "documents_unchanged": self.documents_unchanged, "chunks_removed": self.chunks_removed,
            "documents_removed": self.documents_removed, "skipped_files": [s.to_dict() for s in self.skipped_files],
        }


def _nothing_to_do(paths: list[str], skipped: list[SkippedFile]) -> StoreError:
    where = ", ".join(paths)
    if not skipped:
        return StoreError(f"No text files found in {where}; point ingest at a folder or file of UTF-8 text documents.")
    shown = "; ".join(f"{Path(s.path).name}: {s.reason}" for s in skipped[:5])
    more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
    return StoreError(f"Nothing to ingest in {where}: every file was skipped ({shown}{more}); give UTF-8 text "
                      "files with some text.")


@dataclass
class IngestRequest:
    """What one :func:`ingest` call asks for, resolved once and passed whole to the locked part and the run.

    Attributes: as :func:`ingest`'s arguments; ``pipeline`` already carries ``chunk_prefix``, and
    ``sync_roots`` are the folders whose missing documents are removed (empty: no sync).
    """

    source: str | None
    chunk_tokens: int | None
    dtype: str | None
    embedder: str | None
    device: torch.device | str
    lock_timeout: float | None
    progress: IngestProgress | None
    index_save_every_s: float
    pipeline: PipelineConfig
    sync_roots: list[str]

    @property
    def note(self) -> Callable[[str], None] | None:
        """Where one-line notes go (the progress receiver's), if anywhere."""
        return self.progress.note if self.progress is not None else None


def ingest(
    paths: Iterable[str | Path],
    store: str | Path = DEFAULT_STORE,
    source: str | None = None,
    *,
    chunk_tokens: int | None = None,
    dtype: str | None = None,
    embedder: str | None = None,
    device: torch.device | str = "cpu",
    lock_timeout: float | None = None,
    progress: IngestProgress | None = None,
    index_save_every_s: float = 60.0,
    pipeline: PipelineConfig | None = None,
    chunk_prefix: str | None = None,
    sync: bool = True,
) -> IngestResult:
    """Ingest documents into a store, creating it when absent; resumable and idempotent.

    Args:
        paths: Files and folders (read recursively: UTF-8 text files, judged by content).
        store: Store folder.
        source: Source model; defaults to the store's own, or the pipeline's for a new store.
        chunk_tokens: Chunk size in source tokens (default: the store's, the pipeline's for a new store).
        dtype: KV dtype for a new store (default: the pipeline's); an existing store keeps its own.
        embedder: Embedder for a new store (default: the pipeline's); an existing store keeps its own.
        device: Where the source model prefills.
        lock_timeout: Seconds to wait for another writer (``None``: wait as long as it takes).
        progress: Progress receiver.
        index_save_every_s: Save the index at least this often during long ingests.
        pipeline: Settings of a new store (``source``, ``chunk_tokens``, ``kv_dtype``, ``embedder``) where
            the arguments above are ``None``; default :class:`~mot_cag.config.PipelineConfig` (qwen2-mini,
            256 tokens, float16, all-MiniLM-L6-v2). An existing store ignores it and keeps what it recorded.
        chunk_prefix: What a new store's chunks are prefilled after (``auto``, ``prompt``, ``none``; default:
            the pipeline's, see :class:`~mot_cag.config.PipelineConfig`). An existing store keeps its own.
        sync: For every folder in ``paths``, remove the store's documents under it that this run did not find
            (deleted, moved away, or no longer readable text), with the chunks only they used. A moved file is
            found at its new path and keeps its stored chunks (same content, no prefill).

    Raises:
        StoreError: Nothing readable to ingest; the store belongs to another source model, embedder or dtype;
            the disk is full; another writer holds the store past ``lock_timeout``.
        ModelNotFoundError: The source model is not on this machine.
    """
    t0 = time.perf_counter()
    paths = [str(p) for p in paths]
    files, skipped = discover(paths)
    if not files:
        raise _nothing_to_do(paths, skipped)
    root = Path(store)
    if root.exists() and not root.is_dir():
        raise StoreError(f"--store {root} is a file, not a store folder; pass a folder path (it is created if absent).")
    if chunk_prefix not in (None, "auto") and Store.exists(root):
        have = Store.read_config(root).chunk_prefix
        if have != chunk_prefix:
            raise StoreError(f"Store {root} was made with --chunk-prefix {have}; a store keeps its prefix: drop "
                             "--chunk-prefix or ingest into a new store.")
    req = IngestRequest(source, chunk_tokens, dtype, embedder, device, lock_timeout, progress, index_save_every_s,
                        (pipeline or PipelineConfig()).override(chunk_prefix=chunk_prefix),
                        [p for p in paths if Path(p).is_dir()] if sync else [])
    fresh = not root.exists()
    try:
        result = _ingest_locked(files, skipped, root, req)
    finally:
        if fresh and not Store.exists(root):
            # Nothing was created (the model was missing, say): leave no empty store folder behind.
            (root / LOCK_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                root.rmdir()
    for s in result.skipped_files:
        if req.note is not None:
            req.note(f"skipped {s.path}: {s.reason}")
    if result.documents == 0:
        raise _nothing_to_do(paths, result.skipped_files)
    result.seconds = time.perf_counter() - t0
    return result


def _ingest_locked(files: list[SourceFile], skipped: list[SkippedFile], root: Path, req: IngestRequest) -> IngestResult:
    """The part of :func:`ingest` that runs under the writer lock."""
    from mot_cag.models.layout import KVLayout
    from mot_cag.models.registry import fingerprint, load_config, load_model

    pipeline = req.pipeline
    with WriterLock(root, timeout=req.lock_timeout, on_wait=req.note):
        existing = Store.read_config(root) if Store.exists(root) else None
        # The pipeline only fills in a new store: an existing one keeps the settings it was made with.
        src_name = req.source or (existing.source.name if existing else pipeline.source)
        ref, hf_config = load_config(src_name)
        try:
            layout = KVLayout.from_config(hf_config)
        except ValueError as e:
            raise StoreError(str(e)) from None
        emb_name = canonical_name(req.embedder) if req.embedder else (
            existing.embedder if existing else canonical_name(pipeline.embedder))
        # A new store records the embedding size, so the embedder must be loaded now; an existing one knows it.
        emb = make_embedder(emb_name) if existing is None else None
        prefix_kind, prefix_ids = ((existing.chunk_prefix, existing.prefix_ids) if existing
                                   else chunk_prefix_for(src_name, pipeline.chunk_prefix, layout))
        config = StoreConfig(
            # A local folder is recorded absolute so the store names a model that resolves from anywhere.
            StoreSource(str(ref.path) if ref.origin == "local" else src_name, fingerprint(ref.path), layout),
            dtype=req.dtype or (existing.dtype if existing else pipeline.kv_dtype),
            embedder=emb_name,
            embed_dim=emb.dim if emb is not None else existing.embed_dim,  # type: ignore[union-attr]
            chunk_tokens=existing.chunk_tokens if existing else (req.chunk_tokens or pipeline.chunk_tokens),
            chunk_prefix=prefix_kind,
            prefix_ids=prefix_ids,
        )
        with Store.open_for_write(root, config, embedder=emb) as st:
            # The store keeps the name it was made with: `--source` may be another alias of the same weights.
            result = IngestResult(store=str(root), source=st.source.name, skipped_files=skipped)
            run = _Run(st, req, src_name, req.chunk_tokens or config.chunk_tokens, result, load_model)
            try:
                st.remove_temp_files()
                st.sync_index(write=True)
                run.all(files)
                if req.sync_roots:
                    _drop_missing(st, req.sync_roots, files, result, req.note)
            finally:
                run.close()
                # Also on Ctrl-C: what is committed gets indexed on disk now rather than on the next open.
                st.save_index()
    return result


def _drop_missing(st: Store, roots: list[str], files: list[SourceFile], result: IngestResult, note) -> None:
    """Sync: remove documents under ``roots`` that this run did not find (see :func:`ingest`)."""
    from mot_cag.store.manage import drop_documents, matching_documents

    found = {str(f.path) for f in files}
    gone = [d for d in matching_documents(st, roots) if d not in found]
    if not gone:
        return
    removed = drop_documents(st, gone)
    result.documents_removed += len(removed.documents)
    result.chunks_removed += removed.chunks
    for d in gone:
        if note is not None:
            note(f"removed {d}: no longer in the ingested folder")


def chunk_prefix_for(source: str, kind: str, layout) -> tuple[str, tuple[int, ...]]:
    """The chunk prefix of a new store: ``(kind, prefix token ids)`` for ``auto``, ``prompt`` or ``none``.

    ``prompt`` is the source model's prompt head (:class:`~mot_cag.prompts.PromptFormat`: chat header, system
    text and instruction, or BOS + instruction for base models): every chunk is prefilled after it, so each
    chunk's tokens see the context they are later read in, and the head's first token, not each chunk's, is
    the attention sink. Chunks are moved after prefill, so only RoPE models can use it.

    Raises:
        StoreError: ``prompt`` asked for an absolute-position model, or a model whose prompt has no head.
    """
    if kind == "none":
        return "none", ()
    from mot_cag.models.registry import load_model
    from mot_cag.prompts import prefixes_chunks, prompt_format

    fmt = prompt_format(load_model(source, weights=False))
    if kind == "auto":
        return ("prompt", fmt.head) if prefixes_chunks(fmt, layout.positions) else ("none", ())
    if layout.positions != "rope":
        raise StoreError(f"--chunk-prefix prompt needs a RoPE source model; {source} has absolute positions baked "
                         "into its cache. Use --chunk-prefix none.")
    if not fmt.head:
        raise StoreError(f"{source}'s prompt has no head to prefill chunks after; use --chunk-prefix none.")
    return "prompt", fmt.head


class _Run:
    """State of one ingest run over a list of files.

    Group commit: chunk files are written (temporary name, rename) without their own fsyncs; every
    ``ROW_BATCH`` chunks, at most every ``FLUSH_S`` seconds and at the end, one filesystem sync makes the
    batch durable, then its manifest rows are committed, then the documents it completes. So a row never
    points at a file that a power cut could lose, and a file without a row (written after the last sync) is
    checked in full and adopted, or prefilled again, by the next run. One sync per batch costs less than two
    fsyncs per file (measured: benchmarks/results/README.md).
    """

    #: Chunk files per group commit.
    ROW_BATCH = 32
    #: Longest time between group commits (bounds the work a crash can cost).
    FLUSH_S = 5.0
    #: Committed chunks embedded together.
    EMBED_BATCH = 64

    def __init__(self, st: Store, req: IngestRequest, src_name: str, chunk_tokens: int, result: IngestResult,
                 load_model: Callable[..., LoadedModel]):
        self.st, self.src_name, self.chunk_tokens, self.device = st, src_name, chunk_tokens, req.device
        self.progress, self.result, self.save_every, self._load_model = (req.progress, result,
                                                                         req.index_save_every_s, load_model)
        self.lm = None
        self.prefix_kv: KVChunk | None = None  # the store's chunk prefix, prefilled once
        self.separator = ""  # what follows every chunk as it is read (prefixed stores)
        self.positioner: Positioner | None = None
        self.chunker: Chunker | None = None
        self.last_save = self.last_flush = time.monotonic()
        self.chunks_seen = 0
        self.written: list[WrittenChunk] = []  # files in place, not yet synced nor in the manifest
        self.batch_keys: set[str] = set()
        self.pending_docs: list[DocumentVersion] = []
        self.unembedded = 0

    def _model(self):
        # Loaded only when some file needs chunking: re-ingesting unchanged files never loads weights.
        if self.lm is None:
            self.lm = self._load_model(self.src_name, device=self.device)
            if self.lm.fingerprint != self.st.source.fingerprint:
                raise StoreError(f"Source model '{self.src_name}' changed on disk while ingesting; run again.")
            self.chunker = Chunker(self.lm.tokenizer, self.chunk_tokens)
            prefix = self.st.config.prefix_ids
            if prefix:
                from mot_cag.prompts import prompt_format

                self.prefix_kv = prefill(self.lm.model, torch.tensor(prefix, dtype=torch.long))
                self.positioner = Positioner(self.lm.layout, self.lm.model.config)
                self.separator = prompt_format(self.lm).separator
            if self.progress is not None:
                self.progress.update(-1, self.chunks_seen, self.result.tokens)  # throughput counts from here
        return self.lm

    def _prefill(self, lm, token_ids) -> KVChunk:
        """One chunk's KV, stored at position 0: alone, or after the store's prefix and rotated back to 0."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        if self.prefix_kv is None:
            return prefill(lm.model, ids, start=0)
        assert self.positioner is not None
        return self.positioner.reposition(prefill_after(lm.model, ids, self.prefix_kv), 0)

    def flush(self, final: bool = False) -> None:
        """Group commit: write document records, sync the filesystem, commit chunk rows, then documents."""
        st = self.st
        records = [st.write_document_record(d, durable=False) for d in self.pending_docs]
        if self.written or records:
            st.sync_files([st.root / w.file for w in self.written] + records)
        st.commit_chunks(self.written)
        self.unembedded += len(self.written)
        self.written, self.batch_keys = [], set()
        if final or self.unembedded >= self.EMBED_BATCH:
            st.embed_pending()
            self.unembedded = 0
        for d in self.pending_docs:
            self.result.chunks_removed += st.put_document(d, write_record=False)
        self.pending_docs = []
        self.last_flush = time.monotonic()

    def _maybe_flush(self) -> None:
        if len(self.written) >= self.ROW_BATCH or time.monotonic() - self.last_flush > self.FLUSH_S:
            self.flush()

    def close(self) -> None:
        """After an error or Ctrl-C: make the chunk files written so far durable and commit their rows."""
        try:
            self.pending_docs = []  # their state is unknown after an error: the next run reads them again
            if self.written:
                self.st.sync_files([self.st.root / w.file for w in self.written])
                self.st.commit_chunks(self.written)
        except BaseException:  # noqa: BLE001 - the original error matters more; the next run adopts the files
            pass
        self.written = []

    def all(self, files: list[SourceFile]) -> None:
        if self.progress is not None:
            self.progress.begin(len(files))
        for n, f in enumerate(files, 1):
            self.one(f)
            if self.progress is not None:
                self.progress.update(n, self.chunks_seen, self.result.tokens)
            if time.monotonic() - self.last_save > self.save_every:
                self.flush()
                self.st.save_index()
                self.last_save = time.monotonic()
        self.flush(final=True)

    def _unchanged(self, f: SourceFile) -> bool:
        """Count ``f`` as skipped when the store holds it as it is now (same size and mtime, or same content:
        then its new mtime is recorded)."""
        st, res = self.st, self.result
        doc = st.manifest.document(str(f.path))
        if doc is None:
            return False
        if not (doc.size == f.size and doc.mtime_ns == f.mtime_ns):
            if doc.sha256 != file_sha256(f.path):
                return False
            with st.manifest.transaction():
                st.manifest.touch_document(doc.id, f.mtime_ns)
        res.documents += 1
        res.documents_unchanged += 1
        res.chunks_skipped += doc.chunks
        res.tokens += doc.tokens
        self.chunks_seen += doc.chunks
        return True

    def one(self, f: SourceFile) -> None:
        if self._unchanged(f):
            return
        st, res = self.st, self.result
        docpath = str(f.path)
        lm = self._model()
        assert self.chunker is not None
        hasher = hashlib.sha256()
        places: list[DocChunk] = []
        tokens = 0
        try:
            for c in self.chunker.chunks(read_blocks(f.path, hasher=hasher)):
                if self.separator:
                    # Stored as read: the chunk's text and the separator, tokenized together (".\n\n" is one
                    # token for most BPEs, and the split spelling changes real models' answers).
                    ids = lm.tokenizer(c.text + self.separator, add_special_tokens=False)["input_ids"]
                    c = dataclasses.replace(c, token_ids=tuple(ids))
                key = chunk_key(st.source.fingerprint, c.token_ids, st.config.prefix_ids)
                if key not in self.batch_keys and not st.has_chunk(key) and st.adopt_chunk(key) is None:
                    kv = self._prefill(lm, c.token_ids)
                    self.written.append(st.write_chunk_file(kv, c, docpath, key, durable=False))
                    self.batch_keys.add(key)
                    res.chunks_added += 1  # kept even if this file fails later: content-addressed, reusable
                    self._maybe_flush()
                else:
                    res.chunks_skipped += 1
                places.append(DocChunk(c.index, key, c.char_start, c.char_end))
                tokens += len(c.token_ids)
                self.chunks_seen += 1
                if self.progress is not None and self.chunks_seen % 8 == 0:
                    self.progress.update(-1, self.chunks_seen, res.tokens + tokens)
        except UnicodeDecodeError as e:
            res.skipped_files.append(SkippedFile(docpath, f"not UTF-8 text (byte {e.start} of a block)"))
            return
        except OSError as e:
            res.skipped_files.append(SkippedFile(docpath, f"unreadable ({e.strerror or e})"))
            return
        if not places:
            res.skipped_files.append(SkippedFile(docpath, "empty"))
            return
        self.pending_docs.append(DocumentVersion(docpath, hasher.hexdigest(), f.size, f.mtime_ns, places, tokens))
        res.documents += 1
        res.tokens += tokens
        self._maybe_flush()
