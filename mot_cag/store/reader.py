"""Finding and reading the documents to ingest: UTF-8 text files of any name (``.txt``, ``.md``, ``.rst``,
``LICENSE``, ``README``...), recursively, streamed. A file is judged by its content, not its suffix: it is read
when its first 64 KiB decode as UTF-8 and hold no NUL byte and almost no control characters; formats known to
be binary (images, archives, PDF, model weights) are skipped without reading.

Files the store cannot use (binary, not UTF-8, empty, unreadable, another format) are not errors: they are
returned as :class:`SkippedFile` records so the caller can list them, and only when *nothing* is left does
ingest fail. Text is read in blocks, so a multi-GB file never sits in memory whole; character offsets are
those of the file decoded as UTF-8 with line endings kept as they are (``newline=""``).
"""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Suffixes of formats that are never plain text: skipped without reading (HTML and other markup that is
#: text is read as it is).
BINARY_SUFFIXES = frozenset({
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".ico", ".tif", ".tiff", ".pdf", ".zip", ".gz", ".tgz",
    ".bz2", ".xz", ".zst", ".7z", ".tar", ".whl", ".jar", ".so", ".dll", ".dylib", ".exe", ".o", ".a", ".pyc",
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".npy", ".npz", ".parquet", ".arrow", ".sqlite",
    ".db", ".faiss", ".mp3", ".mp4", ".wav", ".ogg", ".flac", ".mov", ".avi", ".woff", ".woff2", ".ttf", ".otf",
    ".docx", ".xlsx", ".pptx", ".odt",
})
#: Share of control characters (other than tab, line breaks and form feed) above which text is binary.
MAX_CONTROL_SHARE = 0.01

#: Bytes inspected to decide whether a file is text.
SNIFF_BYTES = 64 * 1024

#: Bytes per block when streaming a file.
BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class SourceFile:
    """A file that will be read.

    Attributes:
        path: Absolute path.
        size: Size in bytes.
        mtime_ns: Modification time, used to skip unchanged files without reading them.
    """

    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class SkippedFile:
    """A file that was not ingested, and why (one short phrase)."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"path": self.path, "reason": self.reason}


def discover(paths: Iterable[str | Path]) -> tuple[list[SourceFile], list[SkippedFile]]:
    """Walk ``paths`` (files or folders) and sort what was found into readable text files and skipped ones.

    Hidden files and folders (name starting with ``.``) are ignored silently: they are tool state
    (``.git``), not documents. A file named explicitly is judged like any other.

    Returns:
        ``(files, skipped)``, files in a stable (sorted) order, each path once.
    """
    files: list[SourceFile] = []
    skipped: list[SkippedFile] = []
    seen: set[Path] = set()

    def consider(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.add(path)
        reason = _unusable(path)
        if reason is not None:
            skipped.append(SkippedFile(str(path), reason))
            return
        st = path.stat()
        files.append(SourceFile(path, st.st_size, st.st_mtime_ns))

    for raw in paths:
        root = Path(raw).expanduser()
        if not root.exists():
            skipped.append(SkippedFile(str(root), "does not exist"))
        elif root.is_dir():
            if not os.access(root, os.R_OK | os.X_OK):
                skipped.append(SkippedFile(str(root), "folder not readable"))
                continue
            for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: skipped.append(
                    SkippedFile(str(e.filename), "folder not readable"))):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    if not name.startswith("."):
                        consider(Path(dirpath) / name)
        else:
            consider(root)
    return files, skipped


def _unusable(path: Path) -> str | None:
    """Why ``path`` cannot be ingested, or ``None`` when it looks like a UTF-8 text file."""
    if not path.is_file():
        return "not a regular file"
    if path.suffix.lower() in BINARY_SUFFIXES:
        return f"not a text file ({path.suffix.lower()} is a binary format)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if size == 0 or not head.strip():
        return "empty"
    if b"\x00" in head:
        return "binary"
    try:
        # Incremental decoding: a multi-byte character cut at the sniff boundary is not an error.
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) == size)
    except UnicodeDecodeError:
        return "not UTF-8 text"
    control = sum(1 for ch in text if ord(ch) < 32 and ch not in "\t\n\r\f")
    if control > MAX_CONTROL_SHARE * max(1, len(text)):
        return "binary"
    return None


def read_blocks(path: str | Path, block_bytes: int = BLOCK_BYTES, hasher=None) -> Iterator[str]:
    """Yield a UTF-8 file's text in blocks, reading ``block_bytes`` at a time.

    Line endings are kept as they are, so character offsets are those of the file's decoded text.

    Args:
        path: The file.
        block_bytes: Bytes read per block.
        hasher: A ``hashlib`` object updated with every byte read, so a document's hash describes exactly
            the content that was chunked (and the file is read once).

    Raises:
        UnicodeDecodeError: Past the sniffed head the file stops being UTF-8.
        OSError: The file cannot be read.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    with open(path, "rb") as fh:
        while True:
            raw = fh.read(block_bytes)
            if hasher is not None:
                hasher.update(raw)
            text = decoder.decode(raw, final=not raw)
            if text:
                yield text
            if not raw:
                return


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for buf in iter(lambda: fh.read(1 << 20), b""):
            h.update(buf)
    return h.hexdigest()
