"""The replay-with-substitution forward that translators' replay injection uses (mot_cag.models.cache)."""

from __future__ import annotations

import pytest
import torch

from mot_cag.models.cache import forward, prefill, replay_forward

TEXT = "Tomas Reddick works as a baker. The access code of Tomas Reddick is 48213."


@pytest.mark.parametrize("fam", ["gpt2", "opt", "qwen2"])
def test_substituting_own_kv_reproduces_prefill(tiny_models, fam):
    m = tiny_models[fam]
    ids = torch.tensor(m.tokenizer(TEXT)["input_ids"])
    native = prefill(m.model, ids, start=4)
    top = m.layout.layers - 1
    logits, chunk = replay_forward(m.model, ids, {top: (native.keys[top], native.values[top])}, start=4)
    ref_logits, _ = forward(m.model, ids, None, start=4)
    torch.testing.assert_close(chunk.keys, native.keys)
    torch.testing.assert_close(chunk.values, native.values)
    torch.testing.assert_close(logits, ref_logits)
    assert chunk.start == 4


@pytest.mark.parametrize("fam", ["gpt2", "qwen2"])
def test_substitution_changes_only_the_layer_and_those_above(tiny_models, fam):
    m = tiny_models[fam]
    ids = torch.tensor(m.tokenizer(TEXT)["input_ids"])
    native = prefill(m.model, ids)
    noise_k = torch.randn_like(native.keys[0])
    noise_v = torch.randn_like(native.values[0])
    _, chunk = replay_forward(m.model, ids, {0: (noise_k, noise_v)})
    torch.testing.assert_close(chunk.keys[0], noise_k)
    torch.testing.assert_close(chunk.values[0], noise_v)
    assert not torch.allclose(chunk.keys[1], native.keys[1], atol=1e-4)  # layer 1 read the substituted layer 0


def test_substitution_is_differentiable_and_checks_shapes(tiny_models):
    m = tiny_models["qwen2"]
    ids = torch.tensor(m.tokenizer(TEXT)["input_ids"])
    native = prefill(m.model, ids)
    v = native.values[1].clone().requires_grad_(True)
    logits, _ = replay_forward(m.model, ids, {1: (native.keys[1], v)})
    logits.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shape"):
        replay_forward(m.model, ids, {1: (native.keys[1][:, :-1], native.values[1][:, :-1])})


@pytest.mark.parametrize("fam", ["gpt2", "opt", "qwen2"])
def test_replay_without_logits_stops_below_a_top_window_with_the_same_cache(tiny_models, fam, monkeypatch):
    """A top-aligned window is known K/V: the pass stops at its first layer and returns the same cache."""
    from mot_cag.models import cache as kv

    m = tiny_models[fam]
    ids = torch.tensor(m.tokenizer(TEXT)["input_ids"])
    native = prefill(m.model, ids)
    top = m.layout.layers - 1
    subs = {top: (torch.randn_like(native.keys[top]), torch.randn_like(native.values[top]))}
    _, full = replay_forward(m.model, ids, subs)
    stops = []
    real_stop = kv._StopReplay

    class Counted(real_stop):
        def __init__(self, *a):
            stops.append(1)
            super().__init__(*a)

    monkeypatch.setattr(kv, "_StopReplay", Counted)
    logits, early = replay_forward(m.model, ids, subs, need_logits=False)
    assert logits is None and stops == [1]
    torch.testing.assert_close(early.keys, full.keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(early.values, full.values, rtol=0, atol=1e-6)
    # A window that is not at the top runs the whole pass (layers above it read it).
    _, mid = replay_forward(m.model, ids, {0: (native.keys[0], native.values[0])}, need_logits=False)
    assert stops == [1]
    torch.testing.assert_close(mid.keys, native.keys, rtol=0, atol=1e-5)
