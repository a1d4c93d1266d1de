"""The chunk backend's verbs (store/backend.py): what a store relies on from any place chunks live."""

from __future__ import annotations

import torch

from mot_cag.models.cache import KVChunk
from mot_cag.models.layout import KVLayout
from mot_cag.store import chunkfile
from mot_cag.store.backend import DiskChunks, disk_has_chunks

LAYOUT = KVLayout("qwen2", "qwen2", 2, 2, 4, 8, 32, "rope", 0, 512, 10000.0, "default")


def _chunk_bytes(seed: int, tokens: int = 3) -> tuple[bytes, KVChunk]:
    g = torch.Generator().manual_seed(seed)
    kv = KVChunk(torch.randn(2, 2, tokens, 4, generator=g), torch.randn(2, 2, tokens, 4, generator=g))
    data, _ = chunkfile.encode_chunk(kv, LAYOUT, torch.float32, {"key": f"k{seed}"}, token_ids=list(range(tokens)),
                                     text="abc")
    return data, kv


def test_put_get_contains_delete_round_trip(tmp_path):
    chunks = DiskChunks(tmp_path)
    key_a, key_b = "ab" + "0" * 62, "cd" + "1" * 62
    assert not disk_has_chunks(tmp_path) and not chunks.contains(key_a)
    data, kv = _chunk_bytes(1)
    loc = chunks.put(key_a, data, durable=False)
    chunks.put(key_b, _chunk_bytes(2)[0])
    assert loc == f"chunks/ab/{key_a}.safetensors" and chunks.size(key_a) == len(data)
    tensors, meta = chunks.get(key_a)
    torch.testing.assert_close(tensors["keys"], kv.keys, rtol=0, atol=0)  # exact: stored in float32
    torch.testing.assert_close(tensors["values"], kv.values, rtol=0, atol=0)
    assert chunks.content(key_a)[:2] == ([0, 1, 2], "abc") and meta["key"] == "k1"
    assert list(chunks.keys()) == [key_a, key_b] and chunks.contains_many([key_a, "ef" * 32]) == [True, False]
    chunks.delete_many([key_a, "ef" * 32])  # an absent key is no error
    assert list(chunks.keys()) == [key_b] and disk_has_chunks(tmp_path)


def test_temp_and_misplaced_files_are_not_chunks(tmp_path):
    chunks = DiskChunks(tmp_path)
    key = "ab" + "2" * 62
    chunks.put(key, _chunk_bytes(3)[0])
    tmp = tmp_path / "chunks" / "ab" / f".{key}.safetensors.123.tmp"
    tmp.write_bytes(b"half")
    stray = tmp_path / "chunks" / "ab" / ("ff" * 32 + ".safetensors")
    stray.write_bytes(chunks.path(key).read_bytes())
    assert list(chunks.keys()) == [key]
    assert chunks.misplaced() == [stray] and chunks.temp_files() == [str(tmp)]
    assert chunks.remove_temp() == 1 and not tmp.exists() and chunks.contains(key)
