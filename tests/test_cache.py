"""Cache layer: cached continuation equals a single pass; RoPE chunks move exactly; absolute ones refuse."""

from __future__ import annotations

import pytest
import torch

from mot_cag.errors import MotCagError
from mot_cag.models import cache as kv
from mot_cag.models.positions import Positioner
from mot_cag.store.chunkfile import load_chunk, read_metadata, save_chunk

FAMILIES = ["gpt2", "opt", "qwen2"]
TEXT = "Ana Brell was born in Corvale. Tomas Reddick works as a baker. Mira Hollen plays the violin."


def _ids(lm, text=TEXT):
    return lm.tokenizer(text, return_tensors="pt")["input_ids"][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_continue_equals_single_pass(tiny_models, family):
    lm = tiny_models[family]
    ids = _ids(lm)
    full, _ = kv.forward(lm.model, ids, keep_cache=False)
    for split in (1, ids.shape[0] // 2, ids.shape[0] - 1):
        ctx = kv.prefill(lm.model, ids[:split])
        assert ctx.length == split
        assert ctx.keys.shape == (lm.layout.layers, lm.layout.kv_heads, split, lm.layout.head_dim)
        cont, _ = kv.forward(lm.model, ids[split:], ctx, keep_cache=False)
        torch.testing.assert_close(cont, full[split:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_does_not_mutate_context(tiny_models, family):
    lm = tiny_models[family]
    ids = _ids(lm)
    ctx = kv.prefill(lm.model, ids[:5])
    keys = ctx.keys.clone()
    kv.forward(lm.model, ids[5:], ctx)
    assert ctx.length == 5 and torch.equal(ctx.keys, keys)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_from_cache_matches_greedy_from_text(tiny_models, family):
    lm = tiny_models[family]
    ids = _ids(lm)
    ctx = kv.prefill(lm.model, ids[:-3])
    from_cache = list(kv.greedy_tokens(lm.model, ids[-3:], ctx, max_new_tokens=6))
    from_text = list(kv.greedy_tokens(lm.model, ids, None, max_new_tokens=6))
    assert from_cache == from_text and len(from_cache) == 6


def test_rope_reposition_equals_prefill_at_position(tiny_models):
    lm = tiny_models["qwen2"]
    ids = _ids(lm)
    pos = Positioner(lm.layout, lm.model.config)
    at0 = kv.prefill(lm.model, ids, start=0)
    for p in (7, 100, 400):
        native = kv.prefill(lm.model, ids, start=p)
        moved = pos.reposition(at0, p)
        assert moved.start == p
        torch.testing.assert_close(moved.keys, native.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(moved.values, native.values, atol=1e-4, rtol=0)
    # and back again
    torch.testing.assert_close(pos.reposition(pos.reposition(at0, 300), 0).keys, at0.keys, atol=1e-5, rtol=0)


def test_rope_chunks_concatenated_continue_like_a_joint_prefill_of_separate_chunks(tiny_models):
    """Two chunks prefilled separately at 0, moved and joined, equal the same chunks prefilled at their
    global positions (what a single pass gives up to cross-chunk attention)."""
    lm = tiny_models["qwen2"]
    a, b = _ids(lm, "Ana Brell was born in Corvale."), _ids(lm, " Tomas Reddick works as a baker.")
    pos = Positioner(lm.layout, lm.model.config)
    joined = pos.concat([kv.prefill(lm.model, a), kv.prefill(lm.model, b)])
    reference = kv.join([kv.prefill(lm.model, a, 0), kv.prefill(lm.model, b, start=a.shape[0])])
    q = _ids(lm, "\nQuestion: Where was Ana Brell born?")
    got, _ = kv.forward(lm.model, q, joined, keep_cache=False)
    want, _ = kv.forward(lm.model, q, reference, keep_cache=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_absolute_positions_refuse_reposition(tiny_models, family):
    lm = tiny_models[family]
    chunk = kv.prefill(lm.model, _ids(lm))
    pos = Positioner(lm.layout, lm.model.config)
    assert pos.reposition(chunk, 0) is chunk
    with pytest.raises(MotCagError, match="absolute positions"):
        pos.reposition(chunk, 10)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_absolute_prefill_at_offset_matches_single_pass(tiny_models, family):
    """Prefilling a chunk at its global position (what absolute families must do) is exact."""
    lm = tiny_models[family]
    ids = _ids(lm)
    full, _ = kv.forward(lm.model, ids, keep_cache=False)
    first = kv.prefill(lm.model, ids[:10])
    second, _ = kv.forward(lm.model, ids[10:], first, keep_cache=False)
    torch.testing.assert_close(second, full[10:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_chunk_file_round_trip_is_bit_exact(tiny_models, tmp_path, dtype):
    lm = tiny_models["qwen2"]
    chunk = kv.prefill(lm.model, _ids(lm), start=3).to(dtype=dtype)
    meta = save_chunk(tmp_path / "c.safetensors", chunk, lm.layout, dtype=dtype, metadata={"model": "x"})
    loaded, meta2 = load_chunk(tmp_path / "c.safetensors", verify=True)
    assert torch.equal(loaded.keys, chunk.keys) and torch.equal(loaded.values, chunk.values)
    assert loaded.keys.dtype == dtype and loaded.start == 3
    on_disk = read_metadata(tmp_path / "c.safetensors")
    assert on_disk == meta == meta2
    assert on_disk["model"] == "x" and on_disk["dtype"] == str(dtype).removeprefix("torch.")
    assert on_disk["shape"] == str(list(chunk.keys.shape)).replace(" ", " ")
    assert '"family": "qwen2"' in on_disk["layout"] and on_disk["positions"] == "rope-rotated-at-start"


def test_damaged_chunk_file_is_detected(tiny_models, tmp_path):
    from mot_cag.errors import StoreError

    lm = tiny_models["gpt2"]
    path = tmp_path / "c.safetensors"
    save_chunk(path, kv.prefill(lm.model, _ids(lm)), lm.layout)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="checksum"):
        load_chunk(path, verify=True)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(StoreError):
        load_chunk(path)
