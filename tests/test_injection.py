"""Injection of translated caches over a whole retrieved context: replay-joint and the injection choice."""

from __future__ import annotations

import pytest
import torch

from mot_cag.errors import MotCagError, TranslatorError
from mot_cag.models import cache as kv
from mot_cag.pipeline.context import DirectContext, NativeChunksContext, Piece, ReplayJointContext
from mot_cag.prompts import as_tensor, encode

FAMILIES = ["gpt2", "opt", "qwen2"]
PIECES = ["Ana Brell was born in Corvale. Ana Brell works as a baker.",
          "Tomas Reddick lives in Pastowe. The access code of Tomas Reddick is 48213."]


pytestmark = pytest.mark.usefixtures("one_thread")


def _native_piece(m):
    """What an exact translator would give: the target's own K/V of a piece, made where it will sit."""
    def make(piece: Piece, start: int) -> kv.KVChunk:
        return kv.prefill(m.model, as_tensor(encode(m.tokenizer, piece.text), m.device), start=start)
    return make


@pytest.mark.parametrize("fam", FAMILIES)
def test_replay_joint_layers_below_window_equal_a_single_pass(tiny_models, fam):
    """Below the window the target computes its own K/V over the whole context (cross-chunk attention
    included), so those layers equal one prefill of the joined text; the window holds the substitutes."""
    m = tiny_models[fam]
    pieces = [Piece(t) for t in PIECES]
    layers = list(range(m.layout.layers))
    window = layers[-1:]
    joint = ReplayJointContext(m, _native_piece(m), layers, window).build(pieces)
    direct = DirectContext(m).build(pieces)
    native = NativeChunksContext(m).build(pieces)
    assert joint.ids == direct.ids and joint.tokens == direct.tokens
    below = slice(0, window[0])
    torch.testing.assert_close(joint.kv.keys[below], direct.kv.keys[below], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(joint.kv.values[below], direct.kv.values[below], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(joint.kv.keys[window[0]], native.kv.keys[window[0]], atol=1e-5, rtol=1e-5)
    # The second piece's window K/V differ between one pass and separate pieces (the test is not vacuous).
    assert (direct.kv.keys[window[0]] - native.kv.keys[window[0]]).abs().max() > 1e-3
    assert "prefill_s" in joint.timings and "translate_s" in joint.timings


@pytest.mark.parametrize("fam", FAMILIES)
def test_replay_joint_with_empty_window_is_direct_and_full_window_is_joined(tiny_models, fam):
    m = tiny_models[fam]
    pieces = [Piece(t) for t in PIECES]
    layers = list(range(m.layout.layers))
    direct = DirectContext(m).build(pieces)
    native = NativeChunksContext(m).build(pieces)
    none = ReplayJointContext(m, _native_piece(m), layers, []).build(pieces)
    torch.testing.assert_close(none.kv.keys, direct.kv.keys, atol=1e-4, rtol=1e-4)
    every = ReplayJointContext(m, _native_piece(m), layers, layers).build(pieces)
    torch.testing.assert_close(every.kv.values, native.kv.values, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="window"):
        ReplayJointContext(m, _native_piece(m), layers[:1], layers)


def test_translated_builder_picks_injection(tiny_models, tmp_path):
    """auto = replay-joint for a zoo pair (chunks prefilled alone); each injection gives a cache over the same
    tokens; a bad name and a replay-only translator asked for direct injection are refused clearly."""
    from mot_cag.pipeline.translation import translated_builder
    from mot_cag.translate.checkpoint import save_translator
    from mot_cag.translate.mot import build_translator

    s, t = tiny_models["gpt2"], tiny_models["qwen2"]
    path = save_translator(build_translator(s, t, expert="mlp", experts=2, top_k=1, hidden=16), tmp_path / "tr")
    text = PIECES[0]

    def src_kv(text=text):
        return kv.prefill(s.model, as_tensor(encode(s.tokenizer, text), s.device))

    pieces = [Piece(text, source_kv=src_kv)]
    auto = translated_builder(s, t, path, "auto")
    assert isinstance(auto, ReplayJointContext)
    caches = {inj: translated_builder(s, t, path, inj).build(pieces)
              for inj in ("inject-all", "replay", "replay-joint")}
    n = DirectContext(t).build(pieces).tokens
    for inj, ctx in caches.items():
        assert ctx.tokens == n and ctx.kv.length == n, inj
        assert torch.isfinite(ctx.kv.keys).all()
    # One piece: replaying it alone or joined is the same computation.
    torch.testing.assert_close(caches["replay"].kv.keys, caches["replay-joint"].kv.keys, atol=1e-5, rtol=1e-5)
    assert (caches["inject-all"].kv.keys[0] - caches["replay-joint"].kv.keys[0]).abs().max() > 1e-3
    with pytest.raises(MotCagError, match="injection"):
        translated_builder(s, t, path, "sideways")
    replay_only = save_translator(build_translator(s, t, coverage="replay", expert="mlp", experts=1, hidden=16),
                                  tmp_path / "replay")
    with pytest.raises(TranslatorError, match="replay"):
        translated_builder(s, t, replay_only, "inject-all")
    # The old spelling of inject-all is still understood (and refused the same way here).
    with pytest.raises(TranslatorError, match="replay"):
        translated_builder(s, t, replay_only, "direct")
    assert isinstance(translated_builder(s, t, replay_only, "auto"), ReplayJointContext)
    # The replay window of an inject-all translator is chosen at question time: 1 = every layer translated, which
    # is inject-all; a replay-only translator cannot widen its window.
    whole = translated_builder(s, t, path, "replay-joint", window=1.0)
    assert whole.window == list(range(t.layout.layers))
    torch.testing.assert_close(whole.build(pieces).kv.keys, caches["inject-all"].kv.keys, atol=1e-5, rtol=1e-5)
    assert translated_builder(s, t, path, "replay-joint", window=0.01).window == [t.layout.layers - 1]
    with pytest.raises(MotCagError, match="covers target layers"):
        translated_builder(s, t, replay_only, "replay-joint", window=1.0)
    with pytest.raises(MotCagError, match="share"):
        translated_builder(s, t, path, "replay-joint", window=0.0)


@pytest.mark.parametrize("fam", FAMILIES)
def test_recompute_everything_turns_joined_chunks_into_a_single_pass(tiny_models, fam):
    """The repair setting reaches the builders: ratio 1 recomputes every token (= direct), 0 leaves the
    joined caches alone, and a partial ratio changes only the chosen rows."""
    from mot_cag.pipeline.context import Recompute

    m = tiny_models[fam]
    pieces = [Piece(t) for t in PIECES]
    direct = DirectContext(m).build(pieces)
    plain = NativeChunksContext(m).build(pieces)
    full = NativeChunksContext(m, recompute=Recompute(1.0, "spread")).build(pieces)
    torch.testing.assert_close(full.kv.keys, direct.kv.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full.kv.values, direct.kv.values, atol=1e-4, rtol=1e-4)
    off = NativeChunksContext(m, recompute=Recompute(0.0)).build(pieces)
    assert torch.equal(off.kv.keys, plain.kv.keys)
    some = NativeChunksContext(m, recompute=Recompute(0.2, "start")).build(pieces)
    changed = (some.kv.keys != plain.kv.keys).any(dim=(0, 1, 3))  # (T,)
    second = plain.piece_starts[1]
    assert changed[second] and not changed[:second].any()  # the second piece's first token, nothing before it
    dev = NativeChunksContext(m, recompute=Recompute(0.2, "deviation")).build(pieces)
    assert (dev.kv.keys - direct.kv.keys).abs().max() < (plain.kv.keys - direct.kv.keys).abs().max()


def test_recompute_settings_are_validated():
    from mot_cag.config import PipelineConfig
    from mot_cag.pipeline.context import Recompute

    with pytest.raises(MotCagError, match="fraction"):
        Recompute(1.5)
    with pytest.raises(MotCagError, match="policy"):
        Recompute(0.1, "random")
    with pytest.raises(MotCagError, match="recompute"):
        PipelineConfig(recompute=-0.1)
    with pytest.raises(MotCagError, match="injection"):
        PipelineConfig(injection="sideways")
