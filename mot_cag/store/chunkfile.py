"""One KV chunk per safetensors file, self-describing.

Layout on disk: tensors ``keys`` and ``values``, each ``[layers, kv_heads, seq, head_dim]`` in the stored dtype
(fp16 by default). The safetensors metadata (all strings) records what a reader needs without any other file:
``format`` (``mot-cag-kv/1``), ``layout`` (JSON of :class:`~mot_cag.models.layout.KVLayout`), ``dtype``,
``shape``, ``tokens``, ``start``, ``positions`` (``rope-rotated-at-start`` or ``absolute``), ``checksum``
(sha256 over the raw tensor bytes) and any caller fields (model id, fingerprint, document, text...).
Files are written to a temporary name, fsynced and renamed, so a crash never leaves a half-written chunk.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from mot_cag.errors import StoreError
from mot_cag.models.cache import KVChunk
from mot_cag.models.layout import KVLayout

FORMAT = "mot-cag-kv/1"


def tensor_checksum(keys: torch.Tensor, values: torch.Tensor) -> str:
    """sha256 of the raw bytes of keys then values (contiguous, CPU)."""
    h = hashlib.sha256()
    for t in (keys, values):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
) -> dict[str, str]:
    """Write ``chunk`` atomically; returns the metadata written (including ``checksum``)."""
    path = Path(path)
    keys = chunk.keys.detach().to("cpu", dtype).contiguous()
    values = chunk.values.detach().to("cpu", dtype).contiguous()
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    meta.update({
        "format": FORMAT,
        "layout": json.dumps(layout.to_dict(), sort_keys=True),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": json.dumps(list(keys.shape)),
        "tokens": str(chunk.length),
        "start": str(chunk.start),
        "positions": "rope-rotated-at-start" if layout.positions == "rope" else "absolute",
        "checksum": tensor_checksum(keys, values),
    })
    data = save({"keys": keys, "values": values}, metadata=meta)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return meta


def read_metadata(path: str | Path) -> dict[str, str]:
    """Metadata of a chunk file without reading its tensors.

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
    if meta.get("format") != FORMAT:
        raise StoreError(f"File {path} is not a mot-cag KV chunk (format {meta.get('format')!r}).")
    return meta


def load_chunk(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = False
) -> tuple[KVChunk, dict[str, str]]:
    """Read a chunk (memory-mapped by safetensors) and its metadata.

    Args:
        path: Chunk file.
        device: Where the tensors go.
        dtype: Cast to this dtype (``None`` keeps the stored one).
        verify: Recompute the checksum and raise :class:`StoreError` on mismatch.
    """
    path = Path(path)
    meta = read_metadata(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys, values = f.get_tensor("keys"), f.get_tensor("values")
    except Exception as e:  # noqa: BLE001
        raise StoreError(f"Chunk file {path} is damaged ({e}); run `mot-cag store verify`.") from None
    if verify and tensor_checksum(keys, values) != meta["checksum"]:
        raise StoreError(f"Chunk file {path} fails its checksum; run `mot-cag store verify` and re-ingest.")
    chunk = KVChunk(keys, values, int(meta["start"]))
    if dtype is not None or device != "cpu":
        chunk = chunk.to(device=device, dtype=dtype)
    return chunk, meta
