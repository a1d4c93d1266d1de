"""Finding and reading the documents to ingest: UTF-8 text files of any name (``.txt``, ``.md``, ``.rst``,
``LICENSE``, ``README``...), recursively, streamed. A file is judged by its content, not its suffix: it is read
when its first 64 KiB decode as UTF-8 and hold no NUL byte and almost no control characters; formats known to
be binary (images, archives, model weights) are skipped without reading.

Two formats are read through a parser, so the chunks hold their text rather than their markup: HTML
(``.html``, ``.htm``; the standard library's parser, visible text only) and PDF (``.pdf``; the optional
``pypdf`` package, ``pip install 'mot-cag[pdf]'``, pages separated by a blank line).

Files the store cannot use (binary, not UTF-8, empty, unreadable, another format) are not errors: they are
returned as :class:`SkippedFile` records so the caller can list them, and only when *nothing* is left does
ingest fail. Text is read in blocks, so a multi-GB file never sits in memory whole (a PDF does: its reader
needs the whole file); character offsets are those of the file decoded as UTF-8 with line endings kept as
they are (``newline=""``), or, for HTML and PDF, of the extracted text.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

#: Suffixes of formats that are never plain text: skipped without reading (markup that is text, other than
#: HTML, is read as it is).
BINARY_SUFFIXES = frozenset({
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".ico", ".tif", ".tiff", ".zip", ".gz", ".tgz",
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

#: Suffixes read as HTML: their visible text is ingested, not their markup.
HTML_SUFFIXES = frozenset({".html", ".htm"})

#: The suffix read as PDF, when the optional reader is installed.
PDF_SUFFIX = ".pdf"

#: What to run when a PDF is met without its reader.
PDF_INSTALL_HINT = "pip install 'mot-cag[pdf]'"


class FormatError(OSError):
    """A parsed format (HTML, PDF) could not be read. An ``OSError``, so callers that list unreadable files
    instead of failing (ingest) treat it like any other read error."""


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
            for path in _walk(root, skipped):
                consider(path)
        else:
            consider(root)
    return files, skipped


def _walk(root: Path, skipped: list[SkippedFile]) -> Iterator[Path]:
    """The files under folder ``root`` in sorted order, hidden names left out; unreadable folders go to
    ``skipped``."""
    if not os.access(root, os.R_OK | os.X_OK):
        skipped.append(SkippedFile(str(root), "folder not readable"))
        return
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: skipped.append(
            SkippedFile(str(e.filename), "folder not readable"))):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def _unusable(path: Path) -> str | None:
    """Why ``path`` cannot be ingested, or ``None`` when it looks like a UTF-8 text file (or an HTML file
    with visible text, or a PDF with a text layer)."""
    if not path.is_file():
        return "not a regular file"
    suffix = path.suffix.lower()
    if suffix in BINARY_SUFFIXES:
        return f"not a text file ({suffix} is a binary format)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if size == 0 or not head.strip():
        return "empty"
    if suffix == PDF_SUFFIX:
        return _pdf_unusable(path)
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
    if suffix in HTML_SUFFIXES:
        return _html_unusable(path)
    return None


def read_blocks(path: str | Path, block_bytes: int = BLOCK_BYTES, hasher=None) -> Iterator[str]:
    """Yield a document's text in blocks, reading ``block_bytes`` at a time.

    A UTF-8 file's text comes as it is (line endings kept, so character offsets are those of the file's
    decoded text); an HTML file's is its visible text and a PDF's the text of its pages (see the module).

    Args:
        path: The file.
        block_bytes: Bytes read per block (a PDF is read whole).
        hasher: A ``hashlib`` object updated with every byte read, so a document's hash describes exactly
            the content that was chunked (and the file is read once). It hashes the file's bytes, for
            every format, so it matches :func:`file_sha256`.

    Raises:
        UnicodeDecodeError: Past the sniffed head the file stops being UTF-8.
        FormatError: An HTML or PDF file cannot be parsed, or the PDF reader is not installed.
        OSError: The file cannot be read.
    """
    suffix = Path(path).suffix.lower()
    if suffix == PDF_SUFFIX:
        return _pdf_blocks(path, hasher)
    if suffix in HTML_SUFFIXES:
        return _html_text(_text_blocks(path, block_bytes, hasher))
    return _text_blocks(path, block_bytes, hasher)


def _text_blocks(path: str | Path, block_bytes: int, hasher) -> Iterator[str]:
    """A UTF-8 file's decoded text, block by block (see :func:`read_blocks`)."""
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


# --------------------------------------------------------------------------------------------------- html

#: Elements whose content is never shown: dropped with everything inside them.
_HIDDEN_TAGS = frozenset({"script", "style", "template"})

#: Separators owed between two runs of text, weakest first; the strongest one asked for wins.
_SPACE, _LINE, _PARAGRAPH = 1, 2, 3
_SEPARATORS = {_SPACE: " ", _LINE: "\n", _PARAGRAPH: "\n\n"}

#: Elements that break the text around them (start and end tag alike), and how strongly.
_BREAKS = {
    **dict.fromkeys(("br", "div", "li", "dt", "dd", "tr", "option", "caption", "figcaption", "summary"), _LINE),
    **dict.fromkeys(("p", "h1", "h2", "h3", "h4", "h5", "h6", "title", "section", "article", "header",
                     "footer", "nav", "aside", "main", "blockquote", "pre", "table", "ul", "ol", "dl",
                     "figure", "form", "fieldset", "address", "details", "hr", "body"), _PARAGRAPH),
    **dict.fromkeys(("td", "th"), _SPACE),  # cells of a row stay on one line, but never glued together
}


class _VisibleText(HTMLParser):
    """Collects the text a browser would show: whitespace collapsed, entities decoded, blocks on lines of
    their own, ``<pre>`` kept as written. Fed incrementally; :meth:`take` hands over what is ready."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._out: list[str] = []
        self._hidden = 0  # depth inside hidden elements
        self._pre = 0  # depth inside <pre>
        self._owed = 0  # separator owed before the next text (see _SEPARATORS)
        self._started = False  # no separator before the first text

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in _HIDDEN_TAGS:
            self._hidden += 1
        elif tag == "pre":
            self._pre += 1
        self._owed = max(self._owed, _BREAKS.get(tag, 0))

    def handle_endtag(self, tag: str) -> None:
        # Floored at 0: a stray end tag must not hide or un-<pre> the rest of the page.
        if tag in _HIDDEN_TAGS:
            self._hidden = max(0, self._hidden - 1)
        elif tag == "pre":
            self._pre = max(0, self._pre - 1)
        self._owed = max(self._owed, _BREAKS.get(tag, 0))

    def handle_data(self, data: str) -> None:
        if self._hidden or not data:
            return
        if self._pre:
            self._emit(data)
            return
        words = data.split()
        if data[0].isspace():
            self._owed = max(self._owed, _SPACE)
        if words:
            self._emit(" ".join(words))
            if data[-1].isspace():
                self._owed = _SPACE

    def _emit(self, text: str) -> None:
        if self._started and self._owed:
            self._out.append(_SEPARATORS[self._owed])
        self._out.append(text)
        self._started, self._owed = True, 0

    def take(self) -> str:
        """The text collected since the last call."""
        text = "".join(self._out)
        self._out.clear()
        return text


def _html_text(blocks: Iterable[str]) -> Iterator[str]:
    """The visible text of an HTML document streamed as ``blocks`` of markup."""
    parser = _VisibleText()
    try:
        for block in blocks:
            parser.feed(block)
            text = parser.take()
            if text:
                yield text
        parser.close()
    except AssertionError as e:
        # html.parser still asserts on some malformed declarations (``<![foo``); one bad file must not stop
        # an ingest.
        raise FormatError(f"unparsable HTML: {e}") from e
    text = parser.take()
    if text:
        yield text


def _html_unusable(path: Path) -> str | None:
    """Why an HTML file that is UTF-8 text cannot be ingested (no visible text), or ``None``.

    Reads only until the first visible word, which is near the top of any real page.
    """
    try:
        with contextlib.closing(_html_text(_text_blocks(path, SNIFF_BYTES, None))) as text:
            if any(block.strip() for block in text):
                return None
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return "empty (HTML without visible text)"


# ---------------------------------------------------------------------------------------------------- pdf


def _pypdf():
    """The ``pypdf`` module, or ``None`` when the optional ``pdf`` extra is not installed."""
    try:
        import pypdf
    except ImportError:
        return None
    return pypdf


@contextlib.contextmanager
def _pypdf_quiet() -> Iterator[None]:
    """Silence pypdf's warnings for a while: it logs every repair it makes to a damaged file, and the skip
    reason already tells the user what matters."""
    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _pdf_pages(data: bytes) -> Iterator[str]:
    """The text of each page of the PDF held in ``data``.

    Raises:
        FormatError: pypdf is not installed, or the file is damaged or encrypted.
    """
    pypdf = _pypdf()
    if pypdf is None:
        raise FormatError(f"PDF reader not installed ({PDF_INSTALL_HINT})")
    # pypdf raises many kinds of exception on a malformed file (its own, but also KeyError, ValueError...):
    # any of them means this file cannot be read, never that the ingest should stop.
    try:
        with _pypdf_quiet():
            reader = pypdf.PdfReader(io.BytesIO(data))
            encrypted = reader.is_encrypted
    except Exception as e:
        raise FormatError(f"damaged PDF: {_describe(e)}") from e
    if encrypted:
        # Many encrypted PDFs only restrict printing or copying and open with the empty password.
        try:
            with _pypdf_quiet():
                opened = reader.decrypt("")
        except Exception as e:  # e.g. AES without the ``cryptography`` package
            raise FormatError(f"encrypted PDF: {_describe(e)}") from e
        if not opened:
            raise FormatError("encrypted PDF (needs a password)")
    try:
        with _pypdf_quiet():
            pages = len(reader.pages)
    except Exception as e:
        raise FormatError(f"damaged PDF: {_describe(e)}") from e
    for n in range(pages):
        try:
            with _pypdf_quiet():
                text = reader.pages[n].extract_text()
        except Exception as e:
            raise FormatError(f"damaged PDF: page {n + 1}: {_describe(e)}") from e
        yield text or ""


def _describe(e: BaseException) -> str:
    """An exception as one phrase: its message, or its type when it has none (a bare ``KeyError()``)."""
    return str(e) or type(e).__name__


def _pdf_unusable(path: Path) -> str | None:
    """Why a PDF cannot be ingested (no reader, damaged, no text layer), or ``None``.

    Stops at the first page that has text.
    """
    if _pypdf() is None:
        return f"PDF reader not installed ({PDF_INSTALL_HINT})"
    try:
        if any(text.strip() for text in _pdf_pages(path.read_bytes())):
            return None
    except FormatError as e:
        return str(e)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return "PDF without extractable text (scanned pages? run OCR on it first)"


def _pdf_blocks(path: str | Path, hasher) -> Iterator[str]:
    """A PDF's text, page by page, pages separated by a blank line (see :func:`read_blocks`)."""
    # Read once, and hash the very bytes that are parsed: pypdf would read the whole file into memory anyway.
    with open(path, "rb") as fh:
        data = fh.read()
    if hasher is not None:
        hasher.update(data)
    first = True
    for text in _pdf_pages(data):
        text = text.strip()
        if text:
            yield text if first else "\n\n" + text
            first = False


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for buf in iter(lambda: fh.read(1 << 20), b""):
            h.update(buf)
    return h.hexdigest()
