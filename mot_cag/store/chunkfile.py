"""One KV chunk per safetensors file, self-describing.

Format ``mot-cag-kv/2`` (written now). Tensors:

* ``keys``, ``values``: ``[layers, kv_heads, seq, head_dim]`` in the stored dtype (fp16 by default);
* ``token_ids``: ``[seq]`` int32, the source token ids (optional: the store always writes them);
* ``text_utf8``: ``[bytes]`` uint8, the chunk's text as UTF-8 (optional: the store always writes it).

The safetensors metadata (all strings) records what a reader needs without any other file: ``format``,
``layout`` (JSON of :class:`~mot_cag.models.layout.KVLayout`), ``dtype``, ``shape``, ``tokens``, ``start``,
``positions`` (``rope-rotated-at-start`` or ``absolute``), ``checksum`` and any caller fields (model id,
fingerprint, document, offsets...). ``checksum`` is the sha256 of the raw bytes of ``keys``, ``values``,
``token_ids``, ``text_utf8`` in that order, those present (:func:`chunk_checksum`), so the ids and the text are
covered too. Keeping ids and text out of the JSON header keeps the header small: loading the KV parses a
~1 KB header and never touches them.

Format ``mot-cag-kv/1`` (read, never written): only ``keys`` and ``values``; the token ids (JSON list) and the
text were caller metadata fields ``token_ids`` and ``text``. The checksum rule gives the same value for it
(only ``keys`` and ``values`` are present), and :func:`chunk_token_ids` / :func:`chunk_text` read either form.

Files are written to a temporary name, fsynced and renamed, so a crash never leaves a half-written chunk, and
a chunk file is never modified in place (readers may hold it memory-mapped, see :func:`read_chunk_tensors`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from mot_cag.errors import StoreError
from mot_cag.models.cache import KVChunk
from mot_cag.models.layout import KVLayout

FORMAT = "mot-cag-kv/2"
#: Formats this version reads: 1 kept the token ids and text in the metadata.
READ_FORMATS = ("mot-cag-kv/1", FORMAT)
#: Tensors covered by ``checksum``, in hashing order (those present in a file).
CHECKSUMMED = ("keys", "values", "token_ids", "text_utf8")
KV_TENSORS = ("keys", "values")


class ChunkFileMissing(StoreError):
    """A chunk file does not exist."""


def tensor_checksum(keys: torch.Tensor, values: torch.Tensor, *more: torch.Tensor) -> str:
    """sha256 of the raw bytes of keys, values, then ``more`` (made contiguous, CPU)."""
    h = hashlib.sha256()
    for t in (keys, values, *more):
        h.update(memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()))
    return h.hexdigest()


def chunk_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The ``checksum`` of a chunk file's tensors: :func:`tensor_checksum` over :data:`CHECKSUMMED`, those present.

    Raises:
        KeyError: ``keys`` or ``values`` is missing.
    """
    return tensor_checksum(*(tensors[n] for n in CHECKSUMMED if n in KV_TENSORS or n in tensors))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_chunk(
    path: str | Path,
    chunk: KVChunk,
    layout: KVLayout,
    dtype: torch.dtype = torch.float16,
    metadata: dict[str, str] | None = None,
    token_ids: Sequence[int] | None = None,
    text: str | None = None,
) -> dict[str, str]:
    """Write ``chunk`` atomically and durably (see :func:`encode_chunk`); returns the metadata written."""
    data, meta = encode_chunk(chunk, layout, dtype, metadata, token_ids, text)
    write_atomic(path, data)
    return meta


def read_metadata(path: str | Path) -> dict[str, str]:
    """Metadata of a chunk file without reading its tensors (the header is fully validated by safetensors).

    Raises:
        StoreError: The file is missing, not safetensors, or not a mot-cag chunk.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged headers
        raise StoreError(
            f"Chunk file {path} cannot be read ({e}); run `mot-cag store verify` to list damage."
        ) from None
    _check_format(path, meta)
    return meta


def _check_format(path: str | Path, meta: dict[str, str]) -> None:
    if meta.get("format") not in READ_FORMATS:
        raise StoreError(f"File {path} is not a mot-cag KV chunk this version reads (format {meta.get('format')!r}; "
                         f"reads {', '.join(READ_FORMATS)}).")


def load_chunk(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = False
) -> tuple[KVChunk, dict[str, str]]:
    """Read a chunk (memory-mapped, see :func:`read_chunk_tensors`) and its metadata.

    Args:
        path: Chunk file.
        device: Where the tensors go.
        dtype: Cast to this dtype (``None`` keeps the stored one).
        verify: Recompute the checksum (:func:`chunk_checksum`) and raise :class:`StoreError` on mismatch.
    """
    tensors, meta = read_chunk_tensors(path, None if verify else KV_TENSORS)
    try:
        if verify and chunk_checksum(tensors) != meta.get("checksum"):
            raise StoreError(f"Chunk file {path} fails its checksum; run `mot-cag store verify` and re-ingest.")
        chunk = KVChunk(tensors["keys"], tensors["values"], int(meta["start"]))
    except (KeyError, ValueError) as e:
        raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify` to list damage.") from None
    if dtype is not None or torch.device(device).type != "cpu":
        chunk = chunk.to(device=device, dtype=dtype)
    return chunk, meta


def chunk_token_ids(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[int]:
    """The token ids of a chunk read by :func:`read_chunk_tensors`: tensor ``token_ids``, or (format 1) metadata.

    Raises:
        StoreError: The chunk records no token ids, or they are unreadable.
    """
    if "token_ids" in tensors:
        t = tensors["token_ids"]
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise StoreError(f"token_ids is a {t.dtype} tensor of shape {list(t.shape)}, not int32 [seq]")
        return t.tolist()
    try:
        ids = json.loads(meta["token_ids"])
    except (KeyError, json.JSONDecodeError):
        raise StoreError("no readable token ids") from None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise StoreError("token ids are not a list of integers")
    return ids


def chunk_text(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """The text of a chunk read by :func:`read_chunk_tensors`: tensor ``text_utf8``, or (format 1) metadata.

    Raises:
        StoreError: The chunk records no text, or it is not UTF-8.
    """
    if "text_utf8" in tensors:
        t = tensors["text_utf8"]
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise StoreError(f"text_utf8 is a {t.dtype} tensor of shape {list(t.shape)}, not uint8 [bytes]")
        try:
            return bytes(memoryview(t.numpy())).decode("utf-8")
        except UnicodeDecodeError as e:
            raise StoreError(f"text is not UTF-8 ({e.reason} at byte {e.start})") from None
    if "text" not in meta:
        raise StoreError("no text")
    return meta["text"]


def read_content(path: str | Path) -> tuple[list[int], str, dict[str, str]]:
    """Token ids, text and metadata of a chunk file, whichever format (no checksum checked, KV not touched).

    Raises:
        StoreError: The file is missing or damaged, or records no token ids or text.
    """
    tensors, meta = read_chunk_tensors(path, ("token_ids", "text_utf8"))
    try:
        return chunk_token_ids(tensors, meta), chunk_text(tensors, meta), meta
    except StoreError as e:
        raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify` to list damage.") from None


# Extension (store): loading with tensors that view one private memory map of the file.

_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
                       "I64": torch.int64, "U8": torch.uint8}
_decode_json = json.JSONDecoder().decode  # json.loads minus its per-call type and encoding checks


def read_chunk_tensors(
    path: str | Path, names: Iterable[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors chunk file, the tensors viewing one memory map of the file.

    The file is mapped copy-on-write (``torch.from_file(shared=False)``): nothing is copied, pages are read
    from the page cache when the tensors are first used, writing to the tensors never changes the file.
    Loading costs one ``stat``, one ``mmap`` and parsing the JSON header; reading into a fresh buffer costs a
    copy plus the page faults of new memory, the safetensors loaders one more copy per tensor. The store
    replaces chunk files by renaming and deletes them by unlinking, so a mapping stays valid and unchanged for as
    long as the tensors live; a file rewritten in place by another program would show through in tensors still
    mapping it, and reading past a truncation faults (``SIGBUS``).
    Only JSON and raw bytes are interpreted. Checksums are not checked here (see :func:`load_chunk`).

    Args:
        path: Chunk file.
        names: Tensors to return (those of them present); ``None`` returns all. Others are not validated.

    Raises:
        ChunkFileMissing: There is no file at ``path``.
        StoreError: The file is unreadable, truncated, its header is not a valid safetensors header, or it is
            not a mot-cag chunk.
    """
    fname = os.fspath(path)
    try:
        size = os.stat(fname).st_size
        # uint8 over the whole file; a file shorter than ``size`` by now (replaced meanwhile) raises here.
        buf = torch.from_file(fname, shared=False, size=size, dtype=torch.uint8)
    except (FileNotFoundError, NotADirectoryError):
        raise ChunkFileMissing(f"Chunk file {path} is missing; run `mot-cag store verify` to list damage.") \
            from None
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split("\n")[0]
        raise StoreError(f"Chunk file {path} cannot be read ({reason}); run `mot-cag store verify` to list damage.") \
            from None
    try:
        tensors, meta = _parse(buf, size, names)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify` to list damage.") from None
    _check_format(path, meta)
    return tensors, meta


def _parse(
    buf: torch.Tensor, size: int, names: Iterable[str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a safetensors file held in uint8 ``buf`` into tensor views and metadata (ValueError if damaged)."""
    if size < 8:
        raise ValueError("truncated")
    arr = buf.numpy()
    hlen = int.from_bytes(arr[:8].tobytes(), "little")
    if 8 + hlen > size:
        raise ValueError("header longer than the file")
    header = _decode_json(arr[8:8 + hlen].tobytes().decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a JSON object")
    base, data = 8 + hlen, size - 8 - hlen
    storage = buf.untyped_storage()
    tensors = {}
    for name in header if names is None else names:
        info = header.get(name)
        if info is None:
            continue
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        shape = info["shape"]
        if not 0 <= start <= end <= data or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name} has inconsistent offsets")
        offset = base + start
        if offset % dtype.itemsize:  # unaligned (not written by safetensors): a copy is aligned
            tensors[name] = buf[offset:base + end].clone().view(dtype).view(shape)
        else:  # a view of the map in one op: offset in elements, contiguous strides
            tensors[name] = torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
    return tensors, meta


# Extension (store): group commit. Writing a chunk with ``durable=False`` and calling
# :func:`sync_filesystem` once per batch replaces two fsyncs per file (file, folder) by one filesystem sync
# per batch: measured 7.7 ms -> 0.6 ms per 260 KB chunk on ext4. A caller must not reference such a file
# (manifest row) before the sync.


def encode_chunk(
    chunk: KVChunk,
    layout: KVLayout,
    dtype: torch.dtype = torch.float16,
    metadata: dict[str, str] | None = None,
    token_ids: Sequence[int] | None = None,
    text: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The bytes of ``chunk``'s file (format :data:`FORMAT`), and the metadata in them.

    Args:
        chunk: The KV.
        layout: KV layout of the model that made it.
        dtype: Stored dtype.
        metadata: Caller fields (strings).
        token_ids: Stored as tensor ``token_ids`` (int32) when given.
        text: Stored as tensor ``text_utf8`` when given.

    Raises:
        StoreError: ``token_ids`` do not fit int32, or their number is not the chunk's length.
    """
    tensors = {"keys": chunk.keys.detach().to("cpu", dtype).contiguous(),
               "values": chunk.values.detach().to("cpu", dtype).contiguous()}
    if token_ids is not None:
        try:
            tensors["token_ids"] = torch.tensor(list(token_ids), dtype=torch.int32).reshape(-1)
        except (RuntimeError, OverflowError, TypeError) as e:
            raise StoreError(f"Token ids cannot be stored as int32 ({e}).") from None
        if len(tensors["token_ids"]) != chunk.length:
            raise StoreError(f"{len(tensors['token_ids'])} token ids for a chunk of {chunk.length} tokens.")
    if text is not None:
        raw = bytearray(text.encode("utf-8"))
        tensors["text_utf8"] = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta.update({
        "format": FORMAT,
        "layout": json.dumps(layout.to_dict(), sort_keys=True),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": json.dumps(list(tensors["keys"].shape)),
        "tokens": str(chunk.length),
        "start": str(chunk.start),
        "positions": "rope-rotated-at-start" if layout.positions == "rope" else "absolute",
        "checksum": chunk_checksum(tensors),
    })
    return save(tensors, metadata=meta), meta


def write_atomic(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to a temporary name and rename it to ``path``; fsync file and folder when ``durable``.

    Without ``durable`` a crash can never leave a half-written file under ``path``'s name from a *process*
    crash, but a power cut can lose or tear it until :func:`sync_filesystem` has run.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def sync_filesystem(path: str | Path, written: list[Path] | None = None) -> None:
    """Make every file written so far on ``path``'s filesystem durable (Linux ``syncfs``).

    Where ``syncfs`` is unavailable, fsyncs each of ``written`` and their folders instead.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    for f in written or []:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    for d in {f.parent for f in written or []}:
        _fsync_dir(d)
