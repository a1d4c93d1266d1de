"""Gemma3 family on a tiny random model: sliding-window layers, per-layer RoPE bases, one KV head.

The texts are longer than the tiny model's window (8), so every check reads past it.
"""

from __future__ import annotations

import torch

from mot_cag.models import cache as kv
from mot_cag.models.check import check_model
from mot_cag.models.positions import Positioner, rotate_keys

TEXT = ("Ana Brell was born in Corvale. Tomas Reddick works as a baker. Mira Hollen plays the violin. "
        "The favorite color of Ana Brell is green.")


def _ids(lm, text=TEXT, special=True):
    return lm.tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"][0]


def test_layout_reads_layer_types_and_bases(tiny_gemma3):
    lay = tiny_gemma3.layout
    assert lay.family == "gemma3" and lay.positions == "rope"
    assert lay.kv_heads == 1 and lay.head_dim == 16 and lay.sliding_window == 8
    assert lay.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert lay.layer_rope_theta == (1e4,) * 5 + (1e6,)
    assert lay.rope_theta == 1e6
    assert type(lay).from_dict(lay.to_dict()) == lay  # JSON round trip keeps the tuples


def test_prefill_then_continue_past_the_window_equals_single_pass(tiny_gemma3):
    lm = tiny_gemma3
    ids = _ids(lm)
    assert ids.shape[0] > 3 * lm.layout.sliding_window
    full, _ = kv.forward(lm.model, ids, keep_cache=False)
    for split in (3, 12, ids.shape[0] - 2):
        ctx = kv.prefill(lm.model, ids[:split])
        # Every layer keeps every position (sliding layers included), so chunks stay movable.
        assert ctx.keys.shape == (6, 1, split, 16)
        cont, _ = kv.forward(lm.model, ids[split:], ctx, keep_cache=False)
        torch.testing.assert_close(cont, full[split:], atol=1e-4, rtol=0)


def test_greedy_from_cache_matches_greedy_from_text(tiny_gemma3):
    lm = tiny_gemma3
    ids = _ids(lm)
    ctx = kv.prefill(lm.model, ids[:-3])
    assert list(kv.greedy_tokens(lm.model, ids[-3:], ctx, 12)) == list(kv.greedy_tokens(lm.model, ids, None, 12))


def test_reposition_uses_each_layers_rope_base(tiny_gemma3):
    lm = tiny_gemma3
    ids = _ids(lm, special=False)
    pos = Positioner(lm.layout, lm.model.config)
    at0 = kv.prefill(lm.model, ids, start=0)
    for p in (5, 300):
        native = kv.prefill(lm.model, ids, start=p)
        moved = pos.reposition(at0, p)
        torch.testing.assert_close(moved.keys, native.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(moved.values, native.values, atol=1e-4, rtol=0)
    # One base for all layers would be wrong here: the sliding layers' keys would not match.
    single = rotate_keys(at0.keys, 300, pos.inv_freq)
    assert (single[:5] - kv.prefill(lm.model, ids, start=300).keys[:5]).abs().max() > 1e-2


def test_joined_chunks_past_the_window_continue_like_chunks_prefilled_in_place(tiny_gemma3):
    lm = tiny_gemma3
    a = _ids(lm, "Ana Brell was born in Corvale. Tomas Reddick works as a baker.")
    b = _ids(lm, " Mira Hollen plays the violin. The favorite color of Ana Brell is green.", special=False)
    pos = Positioner(lm.layout, lm.model.config)
    joined = pos.concat([kv.prefill(lm.model, a), kv.prefill(lm.model, b)])
    reference = kv.join([kv.prefill(lm.model, a), kv.prefill(lm.model, b, start=a.shape[0])])
    q = _ids(lm, "\nQuestion: Where was Ana Brell born?", special=False)
    got, _ = kv.forward(lm.model, q, joined, keep_cache=False)
    want, _ = kv.forward(lm.model, q, reference, keep_cache=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_recomputing_every_token_equals_a_single_pass(tiny_gemma3):
    """Selective recompute gives sliding layers their window (a mask per layer type)."""
    lm = tiny_gemma3
    a = _ids(lm, "Ana Brell was born in Corvale. Tomas Reddick works as a baker.")
    b = _ids(lm, " Mira Hollen plays the violin. The favorite color of Ana Brell is green.", special=False)
    ids = torch.cat([a, b])
    joined = Positioner(lm.layout, lm.model.config).concat([kv.prefill(lm.model, a), kv.prefill(lm.model, b)])
    single = kv.prefill(lm.model, ids)
    everything = torch.arange(ids.shape[0])
    # The public call (a tail: plain prefill) and the masked pass (one mask per layer type) must both agree.
    for fixed in (kv.selective_recompute(lm.model, joined, ids, everything),
                  kv._masked_recompute(lm.model, joined, ids, everything)):
        torch.testing.assert_close(fixed.keys, single.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(fixed.values, single.values, atol=1e-4, rtol=0)


def test_models_check_passes_and_reads_past_the_window(tiny_gemma3):
    res = check_model(tiny_gemma3)
    assert res.passed and res.tokens > tiny_gemma3.layout.sliding_window
    assert res.reposition_max_abs_diff is not None


def test_replay_joint_parts_of_some_layers_move_with_their_own_bases(tiny_gemma3):
    """A replay-joint context holds only the translator's layers; moving its parts must rotate each row with its
    layer's RoPE base (a sliding layer and the full layer here), not with the full model's row order."""
    from mot_cag.pipeline.context import NativeChunksContext, Piece, Recompute, ReplayJointContext
    from mot_cag.prompts import as_tensor, encode

    lm = tiny_gemma3
    layers = [3, 5]  # sliding (base 1e4) and full (base 1e6)

    def own_rows(piece, start):  # a stand-in translator: the target's own K/V of those layers, made at 0
        chunk = kv.prefill(lm.model, as_tensor(encode(lm.tokenizer, piece.text)), start=start)
        rows = torch.tensor(layers)
        return kv.KVChunk(chunk.keys[rows], chunk.values[rows], chunk.start)

    pieces = [Piece("Ana Brell was born in Corvale."), Piece("Tomas Reddick works as a baker.")]
    joint = ReplayJointContext(lm, own_rows, layers, window=[5], recompute=Recompute(0.0))
    native = NativeChunksContext(lm, recompute=Recompute(0.0)).join(pieces)
    joined = super(ReplayJointContext, joint).join(pieces)  # the joined parts, before the replay pass
    torch.testing.assert_close(joined.kv.keys, native.kv.keys[torch.tensor(layers)], rtol=0, atol=1e-5)


def test_translator_for_a_gemma3_target_loads_after_saving(tiny_models, tiny_gemma3, tmp_path):
    """Gemma3's per-layer layout fields are tuples in memory and lists in the saved JSON: still the same pair
    (a real smollm2 -> gemma-3-270m translator was refused as 'another layout' after saving)."""
    from mot_cag.translate.checkpoint import load_translator, save_translator
    from mot_cag.translate.mot import build_translator

    s = tiny_models["qwen2"]
    assert isinstance(tiny_gemma3.layout.to_dict()["layer_types"], tuple)
    path = save_translator(build_translator(s, tiny_gemma3, expert="mlp", experts=1, top_k=1, hidden=8),
                           tmp_path / "tr")
    tr = load_translator(path, s, tiny_gemma3)
    assert tr.config.target == tiny_gemma3.name
