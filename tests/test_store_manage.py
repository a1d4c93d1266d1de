"""Store management: re-ingest forgets deleted files and keeps moved ones, `store ls | rm | gc`, and a SIGKILL
in the middle of `rm` or `gc` leaves a store that verifies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from clirun import run_cli

from mot_cag.errors import StoreError

DOCS = {
    "ana.txt": "Ana Brell was born in Corvale. Ana Brell works as a baker and keeps bees on the roof.",
    "tomas.txt": "Tomas Reddick lives in Ostrava. Tomas Reddick plays the cello in a quartet.",
    "mira.txt": "Mira Hollen plays the violin. Mira Hollen is employed by Quorvex in Tarnow.",
}


@pytest.fixture
def folder(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    return docs


def _ingest(tiny_dir, docs, store, **kw):
    from mot_cag.ingest import ingest

    return ingest([docs], store=store, source=str(tiny_dir / "tiny-qwen2"), chunk_tokens=16, embedder="hash", **kw)


def _docs_in(store) -> set[str]:
    from mot_cag.store.manage import documents

    return {d["path"].rsplit("/", 1)[-1] for d in documents(store)}


def _cited(store, question: str) -> set[str]:
    from mot_cag.store.store import Store

    with Store.open(store) as st:
        return {h.doc.rsplit("/", 1)[-1] for h in st.search(question, k=st.info()["chunks"])}


def _chunk_files(store) -> int:
    return len(list((store / "chunks").glob("*/*.safetensors")))


def test_reingest_forgets_a_deleted_file(tiny_dir, folder, tmp_path):
    from mot_cag.store.verify import verify_store

    store = tmp_path / "s"
    _ingest(tiny_dir, folder, store)
    assert "ana.txt" in _cited(store, "Where was Ana Brell born?")
    files_before = _chunk_files(store)
    (folder / "ana.txt").unlink()
    res = _ingest(tiny_dir, folder, store)
    assert res.documents_removed == 1 and res.chunks_removed >= 1 and res.chunks_added == 0
    assert _docs_in(store) == {"tomas.txt", "mira.txt"}
    assert "ana.txt" not in _cited(store, "Where was Ana Brell born?")  # never cited again
    assert _chunk_files(store) == files_before - res.chunks_removed
    assert verify_store(store).ok and not verify_store(store).notes


def test_moved_file_keeps_its_chunks_and_no_sync_keeps_deleted(tiny_dir, folder, tmp_path):
    store = tmp_path / "s"
    _ingest(tiny_dir, folder, store)
    (folder / "sub").mkdir()
    shutil.move(folder / "mira.txt", folder / "sub" / "mira.txt")
    res = _ingest(tiny_dir, folder, store)
    assert res.chunks_added == 0 and res.documents_removed == 1 and res.chunks_removed == 0  # nothing prefilled
    from mot_cag.store.manage import documents

    assert any(d["path"].endswith("sub/mira.txt") for d in documents(store))
    (folder / "tomas.txt").unlink()
    res = _ingest(tiny_dir, folder, store, sync=False)
    assert res.documents_removed == 0 and "tomas.txt" in _docs_in(store)


def test_store_rm_gc_verify_round_trip(tiny_dir, folder, tmp_path, monkeypatch, capsys):
    from mot_cag.store.verify import verify_store

    store = tmp_path / "s"
    _ingest(tiny_dir, folder, store)
    code, out, _ = run_cli(monkeypatch, capsys, "store", "ls", "--store", str(store), "--json")
    assert code == 0 and {d["path"].rsplit("/", 1)[-1] for d in json.loads(out)["documents"]} == set(DOCS)
    code, out, _ = run_cli(monkeypatch, capsys, "store", "rm", str(folder / "ana.txt"), "--store", str(store),
                           "--json")
    rm = json.loads(out)
    assert code == 0 and rm["documents_removed"] == 1 and rm["chunks_removed"] >= 1
    assert _docs_in(store) == {"tomas.txt", "mira.txt"}
    assert "ana.txt" not in _cited(store, "Where was Ana Brell born?")
    # Garbage as interrupted runs leave it: a chunk file without a row, a stale record, a temporary file.
    some = next((store / "chunks").glob("*/*.safetensors"))
    orphan = some.parent / ("ff" * 32 + ".safetensors")
    shutil.copy(some, orphan)
    (store / "documents" / ("0" * 32 + ".json")).write_text(json.dumps({"path": "/nowhere/x.txt"}))
    (some.parent / ".junk.tmp").write_bytes(b"x")
    code, out, _ = run_cli(monkeypatch, capsys, "store", "gc", "--store", str(store), "--json")
    gc = json.loads(out)
    assert code == 0 and gc["chunk_files_removed"] == 1 and gc["records_removed"] == 1 and gc["temp_files_removed"] == 1
    assert not orphan.exists()
    report = verify_store(store)
    assert report.ok and not report.notes
    # Removing a whole folder removes every document under it.
    code, out, _ = run_cli(monkeypatch, capsys, "store", "rm", str(folder), "--store", str(store))
    assert code == 0 and _docs_in(store) == set() and _chunk_files(store) == 0
    code, _, err = run_cli(monkeypatch, capsys, "store", "rm", str(folder / "nothing.txt"), "--store", str(store))
    assert code != 0 and "No document" in err and "Traceback" not in err


def test_rm_of_unknown_path_is_a_clear_error(tiny_dir, folder, tmp_path):
    from mot_cag.store.manage import remove_documents

    store = tmp_path / "s"
    _ingest(tiny_dir, folder, store)
    with pytest.raises(StoreError, match="store ls"):
        remove_documents(store, [tmp_path / "elsewhere"])
    with pytest.raises(StoreError, match="No store"):
        remove_documents(tmp_path / "none", [folder])


KILLER = """
import os, signal, sys
from pathlib import Path
calls = {"n": 0}
real = Path.unlink
def unlink(self, *a, **kw):
    real(self, *a, **kw)
    if self.suffix == ".safetensors":
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
Path.unlink = unlink
from mot_cag.store import manage
"""


@pytest.mark.parametrize("verb", ["rm", "gc"])
def test_sigkill_mid_rm_or_gc_leaves_a_store_that_verifies(tiny_dir, folder, tmp_path, verb):
    from mot_cag.store.manage import gc, remove_documents
    from mot_cag.store.verify import verify_store

    store = tmp_path / "s"
    (folder / "long.txt").write_text(" ".join(f"Person {i} lives in town {i}." for i in range(40)))
    _ingest(tiny_dir, folder, store)
    if verb == "gc":
        # Make garbage first: drop the long document's rows but keep its chunk files (as a crash would).
        from mot_cag.store.store import Store

        with Store.open(store) as st, st.manifest.transaction():
            st.manifest.delete_document(str((folder / "long.txt").resolve()))
        call = f"manage.gc({str(store)!r})"
    else:
        call = f"manage.remove_documents({str(store)!r}, [{str(folder / 'long.txt')!r}])"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLER) + call], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # killed in the middle, as intended
    report = verify_store(store)
    assert report.ok, report.to_dict()
    assert "long.txt" not in _docs_in(store)
    assert "long.txt" not in _cited(store, "Where does Person 7 live?")
    if verb == "rm":
        remove_documents(store, [folder / "ana.txt"])
    gc(store)
    report = verify_store(store)
    assert report.ok and not report.notes, report.to_dict()
    assert _ingest(tiny_dir, folder, store, sync=False).documents == len(DOCS) + 1  # the store still ingests
