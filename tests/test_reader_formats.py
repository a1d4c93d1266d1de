"""Formats ingest reads through a parser: HTML (visible text, standard library) and PDF (optional pypdf)."""

from __future__ import annotations

import hashlib
import io
import sys

import pytest

from mot_cag.ingest.documents import PDF_INSTALL_HINT, discover, read_blocks

PAGE = """<!DOCTYPE html>
<html><head><title>Notes</title>
<style>p { color: red }</style>
<script>var secret = "<p>Script text</p>";</script></head>
<body><h1>Corvale &amp; Ærø</h1>
<p>Ana   Brell was
   born in <b>Corvale</b>.</p><!-- a comment -->
<p>Caf&eacute; &lt;open&gt; &#8212; daily</p>
<ul><li>bread</li><li>tea</li></ul>
</body></html>
"""


def reasons_of(skipped) -> dict[str, str]:
    return {s.path.rsplit("/", 1)[-1]: s.reason for s in skipped}


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one text line per page (empty string: a page without text, like a scan)."""
    font = 3 + 2 * len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(pages)))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode()]
    for i, text in enumerate(pages):
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
                       f"/Resources << /Font << /F1 {font} 0 R >> >> >>".encode())
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode() if text else b""
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (n, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


# --- HTML ---------------------------------------------------------------------------------------------------


def test_html_is_read_as_its_visible_text(tmp_path):
    path = tmp_path / "page.html"
    path.write_text(PAGE, encoding="utf-8")
    files, skipped = discover([tmp_path])
    assert [f.path.name for f in files] == ["page.html"] and not skipped
    h = hashlib.sha256()
    text = "".join(read_blocks(path, block_bytes=16, hasher=h))  # small blocks: tags and entities cut in two
    assert text == ("Notes\n\nCorvale & Ærø\n\nAna Brell was born in Corvale.\n\nCafé <open> — daily\n\n"
                    "bread\ntea")
    assert "secret" not in text and "color" not in text and "comment" not in text
    # The hash is the file's, as for any file: an unchanged page is recognised without parsing it.
    assert h.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_htm_suffix_and_case_are_html_too(tmp_path):
    (tmp_path / "old.HTM").write_text("<p>one</p><p>two</p>", encoding="utf-8")
    assert "".join(read_blocks(tmp_path / "old.HTM")) == "one\n\ntwo"


def test_html_without_visible_text_is_skipped_with_a_reason(tmp_path):
    (tmp_path / "shell.html").write_text("<html><head><script>render()</script><style>b{}</style></head>"
                                         "<body> <!-- filled in by JavaScript --> </body></html>")
    (tmp_path / "notes.txt").write_text("Mira Hollen plays the violin.")
    files, skipped = discover([tmp_path])
    assert [f.path.name for f in files] == ["notes.txt"]
    assert reasons_of(skipped) == {"shell.html": "empty (HTML without visible text)"}


def test_unparsable_html_is_a_read_error_not_a_crash(tmp_path):
    """html.parser asserts on some malformed markup: ingest must see an OSError it lists, not stop."""
    path = tmp_path / "bad.html"
    path.write_text("<p>Ana Brell</p><![bogus section")
    with pytest.raises(OSError, match="unparsable HTML"):
        "".join(read_blocks(path))
    assert "unparsable HTML" in reasons_of(discover([path])[1])["bad.html"]


# --- PDF ----------------------------------------------------------------------------------------------------


def test_pdf_is_read_page_by_page(tmp_path):
    pypdf = pytest.importorskip("pypdf")
    data = make_pdf(["Ana Brell was born in Corvale.", "", "Mira Hollen plays the violin."])
    # The hand-made file is what pypdf itself reads, so the test checks the reader, not the fixture.
    pages = [page.extract_text() for page in pypdf.PdfReader(io.BytesIO(data)).pages]
    assert pages == ["Ana Brell was born in Corvale.", "", "Mira Hollen plays the violin."]
    path = tmp_path / "doc.pdf"
    path.write_bytes(data)
    files, skipped = discover([tmp_path])
    assert [f.path.name for f in files] == ["doc.pdf"] and not skipped
    h = hashlib.sha256()
    text = "".join(read_blocks(path, hasher=h))
    assert text == "Ana Brell was born in Corvale.\n\nMira Hollen plays the violin."  # blank page left out
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()


def test_pdf_without_pypdf_is_skipped_with_the_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pypdf", None)  # makes `import pypdf` fail, installed or not
    path = tmp_path / "doc.pdf"
    path.write_bytes(make_pdf(["Ana Brell was born in Corvale."]))
    (tmp_path / "notes.txt").write_text("Mira Hollen plays the violin.")
    files, skipped = discover([tmp_path])
    assert [f.path.name for f in files] == ["notes.txt"]
    assert PDF_INSTALL_HINT == "pip install 'mot-cag[pdf]'"
    assert reasons_of(skipped) == {"doc.pdf": f"PDF reader not installed ({PDF_INSTALL_HINT})"}
    with pytest.raises(OSError, match="mot-cag\\[pdf\\]"):  # a file listed earlier, read after an uninstall
        list(read_blocks(path))


def test_damaged_pdf_is_skipped_with_a_reason_and_nothing_else_lost(tmp_path):
    pytest.importorskip("pypdf")
    data = make_pdf(["Ana Brell was born in Corvale."])
    (tmp_path / "cut.pdf").write_bytes(data[:40])
    (tmp_path / "fake.pdf").write_bytes(b"this was never a PDF\n" * 20)
    (tmp_path / "good.pdf").write_bytes(data)
    (tmp_path / "notes.txt").write_text("Mira Hollen plays the violin.")
    files, skipped = discover([tmp_path])
    assert [f.path.name for f in files] == ["good.pdf", "notes.txt"]
    reasons = reasons_of(skipped)
    assert set(reasons) == {"cut.pdf", "fake.pdf"}
    assert all(r.startswith("damaged PDF: ") for r in reasons.values()), reasons
    # Read directly (a file that went bad after discovery): an OSError, which ingest lists as unreadable.
    with pytest.raises(OSError, match="damaged PDF"):
        list(read_blocks(tmp_path / "cut.pdf"))


def test_pdf_without_a_text_layer_is_skipped_with_a_reason(tmp_path):
    pytest.importorskip("pypdf")
    (tmp_path / "scan.pdf").write_bytes(make_pdf(["", ""]))
    files, skipped = discover([tmp_path])
    assert not files
    assert reasons_of(skipped)["scan.pdf"].startswith("PDF without extractable text")
