"""Chunk-file format: format 2 keeps token ids and text in tensors; format-1 stores still load, verify, rebuild."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mot_cag.errors import StoreError
from mot_cag.ingest import ingest
from mot_cag.models.cache import KVChunk
from mot_cag.models.layout import KVLayout
from mot_cag.store import chunkfile
from mot_cag.store.store import Store
from mot_cag.store.verify import check_chunk_file, verify_store

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest import keyset, write_corpus  # noqa: E402

#: The fields format-1 writers covered by ``meta_checksum``, spelled out here so that the test pins the old files.
V1_META_FIELDS = ("key", "source", "fingerprint", "token_ids", "text", "doc", "chunk_index", "char_start",
                  "char_end", "special_tokens")

LAYOUT = KVLayout("qwen2", "qwen2", 2, 2, 4, 8, 32, "rope", 0, 512, 10000.0, "default")
ODD_TEXT = 'Zoë Brell — Ærøskøbing, 東京 🚀 "quoted" back\\slash\nnew line\ttab \x00nul \u2028end'


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_dir):
    """A store of the test corpus (format 2), ingested once; copy it before changing it."""
    root = tmp_path_factory.mktemp("format")
    corpus = write_corpus(root / "docs")
    (corpus / "unicode.txt").write_text("Zoë Brell lives in Ærøskøbing — a town of ünïcode names. "
                                        "Søren Ødegård was born in Tromsø, near 東京 Street.\n", encoding="utf-8")
    ingest([corpus], root / "store", str(tiny_dir / "tiny-qwen2"), chunk_tokens=32, embedder="hash")
    return corpus, root / "store"


@pytest.fixture
def store(built, tmp_path) -> Path:
    shutil.copytree(built[1], tmp_path / "store")
    return tmp_path / "store"


def snapshot(store: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[int], str]]:
    """KV (copied), token ids and text of every chunk."""
    out = {}
    with Store.open(store) as st:
        for key in keyset(store):
            kv, info = st.load(key), st.chunk_info(key)
            out[key] = (kv.keys.clone(), kv.values.clone(), info.token_ids, info.text)
    return out


def rewrite_as_format_1(path: Path) -> tuple[str, int]:
    """Rewrite a chunk file the way format-1 writers did; returns its checksum and size (for the manifest)."""
    tensors = load_file(str(path))  # a copy, read by safetensors itself
    ids, text, meta = chunkfile.read_content(path)
    old = {k: v for k, v in meta.items() if k not in ("format", "checksum", "meta_checksum")}
    old.update(format="mot-cag-kv/1", token_ids=json.dumps(ids), text=text)
    old["meta_checksum"] = hashlib.sha256(json.dumps({k: old.get(k, "") for k in V1_META_FIELDS},
                                                     sort_keys=True).encode()).hexdigest()
    h = hashlib.sha256()
    for name in ("keys", "values"):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    old["checksum"] = h.hexdigest()
    path.unlink()  # a new inode: our reader may still map the old one
    save_file({"keys": tensors["keys"], "values": tensors["values"]}, str(path), metadata=old)
    return old["checksum"], path.stat().st_size


def convert_store_to_format_1(store: Path) -> None:
    """Every chunk file back to format 1, and the manifest rows as a format-1 ingest wrote them."""
    db = sqlite3.connect(store / "manifest.sqlite")
    for key in keyset(store):
        checksum, size = rewrite_as_format_1(next((store / "chunks").glob(f"*/{key}.safetensors")))
        db.execute("UPDATE chunks SET checksum = ?, bytes = ? WHERE key = ?", (checksum, size, key))
    db.commit()
    db.close()


def assert_same_content(store: Path, want: dict) -> None:
    with Store.open(store) as st:
        assert set(keyset(store)) == set(want)
        for key, (keys, values, ids, text) in want.items():
            for kv in (st.load(key), st.load(key, verify=True)):
                assert torch.equal(kv.keys, keys) and torch.equal(kv.values, values) and kv.start == 0
            info = st.chunk_info(key)
            assert info.token_ids == ids and info.text == text


def region(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` in a safetensors file."""
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:8 + hlen])[name]["data_offsets"]
    return 8 + hlen + start, 8 + hlen + end


# ------------------------------------------------------------------------------------------------ format 2


@pytest.mark.parametrize("text", [ODD_TEXT, ""])
def test_format_2_round_trips_text_and_ids_exactly(tmp_path, text):
    kv = KVChunk(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), 0)
    ids = [0, 17, 151642, 2**31 - 1, 3]
    path = tmp_path / "c.safetensors"
    meta = chunkfile.save_chunk(path, kv, LAYOUT, metadata={"doc": "a.txt"}, token_ids=ids, text=text)
    assert meta["format"] == chunkfile.FORMAT == "mot-cag-kv/2"
    assert "token_ids" not in meta and "text" not in meta  # not in the JSON header any more
    got_ids, got_text, got_meta = chunkfile.read_content(path)
    assert got_ids == ids and got_text == text and got_meta == meta
    # Plain safetensors: any reader sees the ids and the UTF-8 bytes, and the checksum covers them.
    plain = load_file(str(path))
    assert plain["token_ids"].dtype == torch.int32 and plain["token_ids"].tolist() == ids
    assert plain["text_utf8"].dtype == torch.uint8 and bytes(plain["text_utf8"].tolist()) == text.encode()
    assert meta["checksum"] == chunkfile.tensor_checksum(kv.keys.half(), kv.values.half(), plain["token_ids"],
                                                         plain["text_utf8"])
    chunk, _ = chunkfile.load_chunk(path, verify=True)
    assert torch.equal(chunk.keys, kv.keys.half()) and torch.equal(chunk.values, kv.values.half())


def test_format_2_rejects_ids_it_cannot_store(tmp_path):
    kv = KVChunk(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), 0)
    with pytest.raises(StoreError, match="int32"):
        chunkfile.encode_chunk(kv, LAYOUT, token_ids=[1, 2**31, 3])
    with pytest.raises(StoreError, match="2 token ids for a chunk of 3"):
        chunkfile.encode_chunk(kv, LAYOUT, token_ids=[1, 2])


def test_store_writes_format_2_and_keeps_unicode_text(built, tiny_models):
    corpus, store = built
    tok = tiny_models["qwen2"].tokenizer
    doc = (corpus / "unicode.txt").read_text(encoding="utf-8")
    with Store.open(store) as st:
        hits = [h for h in st.search("Where was Søren Ødegård born?", k=20) if h.doc.endswith("unicode.txt")]
        assert hits
        for h in hits:
            assert chunkfile.read_metadata(h.path)["format"] == "mot-cag-kv/2"
            info = st.chunk_info(h.key)
            assert info.text == h.text == doc[h.char_start:h.char_end]
            assert info.token_ids == tok(info.text, add_special_tokens=False)["input_ids"]
    assert any(not h.text.isascii() for h in hits)


def test_load_reads_kv_only_and_its_tensors_are_private(store):
    key = sorted(keyset(store))[0]
    path = next((store / "chunks").glob(f"*/{key}.safetensors"))
    before = path.read_bytes()
    with Store.open(store) as st:
        ids_at = region(path, "token_ids")
        raw = bytearray(before)
        raw[ids_at[0]] ^= 0x40
        path.unlink()
        path.write_bytes(bytes(raw))
        kv = st.load(key)  # the ids are neither decoded nor checked without verify
        kv.keys.add_(1.0)  # copy-on-write: the file does not change
        assert path.read_bytes() == bytes(raw)
        path.unlink()
        path.write_bytes(before)
        assert torch.equal(st.load(key, verify=True).keys + 1.0, kv.keys)


def test_missing_or_damaged_file_errors_say_to_verify(store, tmp_path):
    key = sorted(keyset(store))[0]
    path = next((store / "chunks").glob(f"*/{key}.safetensors"))
    path.unlink()
    with Store.open(store) as st:
        for fn in (st.load, st.chunk_info, lambda k: st.load(k, verify=True)):
            with pytest.raises(StoreError, match=f"Chunk {key} is not in store .*`mot-cag store verify --store"):
                fn(key)
        path.write_bytes(b"")
        with pytest.raises(StoreError, match="damaged.*mot-cag store verify"):
            st.load(key)
    with pytest.raises(chunkfile.ChunkFileMissing, match="missing.*mot-cag store verify"):
        chunkfile.read_chunk_tensors(tmp_path / "nope.safetensors")
    with pytest.raises(StoreError, match="cannot be read.*mot-cag store verify"):
        chunkfile.read_chunk_tensors(tmp_path)  # a folder
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "something/3"})
    with pytest.raises(StoreError, match="not a mot-cag KV chunk"):
        chunkfile.read_chunk_tensors(tmp_path / "other.safetensors")


@pytest.mark.parametrize("tensor", ["token_ids", "text_utf8"])
def test_flipped_byte_in_ids_or_text_is_found_by_verify_and_repaired(built, store, tensor):
    corpus, _ = built
    key = sorted(keyset(store))[2]
    path = next((store / "chunks").glob(f"*/{key}.safetensors"))
    start, end = region(path, tensor)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    reason = check_chunk_file(path, key, Store.read_config(store).source)
    assert reason in ("tensor data fails its checksum", "token ids do not hash to the chunk key")
    report = verify_store(store)
    assert not report.ok and [p.subject for p in report.problems] == [key]
    with Store.open(store) as st, pytest.raises(StoreError, match="checksum"):
        st.load(key, verify=True)
    assert verify_store(store, repair=True).ok and not path.exists()
    assert ingest([corpus], store).chunks_added == 1 and verify_store(store).ok


# ------------------------------------------------------------------------------------------------ format 1


def test_format_1_store_loads_verifies_and_rebuilds_its_manifest(built, store, tmp_path):
    corpus, _ = built
    want = snapshot(store)
    convert_store_to_format_1(store)
    for f in (store / "chunks").glob("*/*.safetensors"):
        meta = chunkfile.read_metadata(f)
        assert meta["format"] == "mot-cag-kv/1" and "token_ids" in meta and "text" in meta
        assert set(load_file(str(f))) == {"keys", "values"}
    assert_same_content(store, want)
    report = verify_store(store)
    assert report.ok and not report.problems and not report.notes, report.to_dict()
    with Store.open(store) as st:
        info = st.info()
        found = [(h.key, h.text) for h in st.search("What is the access code of Lisse Ombar?", k=3)]

    # The manifest is lost: it is rebuilt from the format-1 files alone.
    for p in store.glob("manifest.sqlite*"):
        p.unlink()
    report = verify_store(store, repair=True)
    assert report.ok, report.to_dict()
    assert_same_content(store, want)
    with Store.open(store) as st:
        assert st.info() == info
        assert [(h.key, h.text) for h in st.search("What is the access code of Lisse Ombar?", k=3)] == found

    # New ingests add format-2 files beside the old ones; the mixed store verifies.
    (corpus.parent / "more").mkdir()
    (corpus.parent / "more" / "pell.txt").write_text("Pell Anwick was born in Sorrow Ford. Pell Anwick is a smith.\n")
    assert ingest([corpus.parent / "more"], store).chunks_added >= 1
    formats = {chunkfile.read_metadata(f)["format"] for f in (store / "chunks").glob("*/*.safetensors")}
    assert formats == {"mot-cag-kv/1", "mot-cag-kv/2"}
    assert verify_store(store).ok
    assert_same_content(store, {**want, **{k: v for k, v in snapshot(store).items() if k not in want}})


def test_damaged_format_1_metadata_is_found(store):
    convert_store_to_format_1(store)
    key = sorted(keyset(store))[1]
    path = next((store / "chunks").glob(f"*/{key}.safetensors"))
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    text = json.loads(raw[8:8 + hlen])["__metadata__"]["text"]
    i = raw.index(text[:12].encode())  # the text, inside the JSON header
    path.write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    assert check_chunk_file(path, key, Store.read_config(store).source) == "metadata fails its checksum"
    assert [p.subject for p in verify_store(store).problems] == [key]
