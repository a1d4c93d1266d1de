"""Selective recompute (CacheBlend-style repair of joined chunks) and the policies that pick its tokens."""

from __future__ import annotations

import pytest
import torch

from mot_cag.errors import MotCagError
from mot_cag.models import cache as kv
from mot_cag.models import recompute as rc
from mot_cag.models.positions import Positioner
from mot_cag.names import POSITIONAL_POLICIES

FAMILIES = ["gpt2", "opt", "qwen2"]
PIECES = ("Ana Brell was born in Corvale.", " Tomas Reddick works as a baker.")
QUESTION = "\nQuestion: Where was Ana Brell born?"
ATOL = 1e-4  # fp32 on CPU: different attention kernels (custom mask vs causal) differ by ~1e-7


def _ids(lm, text):
    return lm.tokenizer(text, return_tensors="pt")["input_ids"][0]


def _two_pieces(lm):
    """``(ids, joined, boundary)``: two pieces prefilled separately at their global positions, joined."""
    a, b = _ids(lm, PIECES[0]), _ids(lm, PIECES[1])
    if lm.layout.positions == "rope":
        second = Positioner(lm.layout, lm.model.config).reposition(kv.prefill(lm.model, b), a.shape[0])
    else:
        second = kv.prefill(lm.model, b, start=a.shape[0])
    return torch.cat([a, b]), kv.join([kv.prefill(lm.model, a), second]), a.shape[0]


def _sequential_reference(model, chunk, ids, indices):
    """Recompute selected tokens one at a time with the plain causal ``forward``: token ``i`` runs after rows
    ``< i`` of the chunk as repaired so far. Same attention pattern as selective_recompute, built another way."""
    keys, values = chunk.keys.clone(), chunk.values.clone()
    for i in sorted(set(indices)):
        context = kv.KVChunk(keys[:, :, :i], values[:, :, :i], chunk.start)
        _, out = kv.forward(model, ids[i:i + 1], context if i else None, start=chunk.start + i)
        keys[:, :, i], values[:, :, i] = out.keys[:, :, -1], out.values[:, :, -1]
    return kv.KVChunk(keys, values, chunk.start)


def _masked(model, chunk, ids, indices):
    """The masked pass of selective recompute, used even where the selection is a tail."""
    return kv._masked_recompute(model, chunk, ids, torch.tensor(sorted(set(indices)), dtype=torch.long))


def _max_diff(a: kv.KVChunk, b: kv.KVChunk) -> float:
    return max((a.keys - b.keys).abs().max().item(), (a.values - b.values).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputing_every_token_equals_single_pass(tiny_models, family):
    lm = tiny_models[family]
    ids, joined, boundary = _two_pieces(lm)
    full = kv.prefill(lm.model, ids)
    assert _max_diff(joined, full) > 1e-2  # the joined cache really misses cross-chunk attention
    for indices in (range(ids.shape[0]), range(boundary, ids.shape[0])):  # all, or all of the second piece
        # A tail is recomputed as a plain prefill after the rows before it; the masked pass must agree.
        for recompute in (kv.selective_recompute, _masked):
            repaired = recompute(lm.model, joined, ids, indices)
            assert repaired.start == joined.start and repaired.keys.shape == joined.keys.shape
            torch.testing.assert_close(repaired.keys, full.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(repaired.values, full.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputing_all_tokens_ignores_the_given_kv(tiny_models, family):
    """With every token selected, no cached entry may be visible: garbage K/V still give a clean prefill."""
    lm = tiny_models[family]
    ids, joined, _ = _two_pieces(lm)
    torch.manual_seed(0)
    garbage = kv.KVChunk(torch.randn_like(joined.keys) * 5, torch.randn_like(joined.values) * 5, joined.start)
    for recompute in (kv.selective_recompute, _masked):
        repaired = recompute(lm.model, garbage, ids, list(range(ids.shape[0])))
        assert _max_diff(repaired, kv.prefill(lm.model, ids)) <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_subset_recompute_matches_reference_and_leaves_other_rows_alone(tiny_models, family):
    lm = tiny_models[family]
    ids, joined, boundary = _two_pieces(lm)
    full = kv.prefill(lm.model, ids)
    indices = [boundary + 3, boundary, 2, boundary + 5, boundary]  # unsorted, a duplicate, one in piece 1
    repaired = kv.selective_recompute(lm.model, joined, ids, indices)
    chosen = sorted(set(indices))
    others = [i for i in range(ids.shape[0]) if i not in chosen]
    # Unselected rows: bit-for-bit the joined cache's.
    assert torch.equal(repaired.keys[:, :, others], joined.keys[:, :, others])
    assert torch.equal(repaired.values[:, :, others], joined.values[:, :, others])
    # Selected rows: what token-by-token causal recomputation gives, in every layer.
    assert _max_diff(repaired, _sequential_reference(lm.model, joined, ids, indices)) <= ATOL
    # Layer 0 depends only on token and position, so selected rows there equal the single pass.
    torch.testing.assert_close(repaired.keys[0, :, chosen], full.keys[0, :, chosen], atol=ATOL, rtol=0)
    # Row 2 sits in the first piece, whose context was complete: recomputing it changes nothing.
    torch.testing.assert_close(repaired.keys[:, :, 2], full.keys[:, :, 2], atol=ATOL, rtol=0)
    # The second piece's first token, the only selected one after the boundary with no selected predecessor in
    # its piece, now sees piece one: it is exact in every layer, which the joined cache was not.
    torch.testing.assert_close(repaired.values[:, :, boundary], full.values[:, :, boundary], atol=ATOL, rtol=0)
    assert (joined.values[:, :, boundary] - full.values[:, :, boundary]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_the_custom_mask_is_what_the_model_uses(tiny_models, family, monkeypatch):
    """A mask that leaves the stale cached entries of selected tokens visible must change the result."""
    lm = tiny_models[family]
    ids, joined, boundary = _two_pieces(lm)
    indices = list(range(boundary, ids.shape[0] - 1))  # not a tail: the masked pass
    good = kv.selective_recompute(lm.model, joined, ids, indices)

    original = kv._recompute_mask

    def leaky(sel, n_tokens, dtype):
        mask = original(sel, n_tokens, dtype)
        mask[0, 0, :, :n_tokens][torch.arange(n_tokens)[None, :] <= sel[:, None]] = 0.0  # stale entries visible
        return mask

    monkeypatch.setattr(kv, "_recompute_mask", leaky)
    bad = kv.selective_recompute(lm.model, joined, ids, indices)
    assert _max_diff(bad, good) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_question_logits_after_repair_match_single_pass(tiny_models, family):
    lm = tiny_models[family]
    ids, joined, boundary = _two_pieces(lm)
    q = _ids(lm, QUESTION)
    want, _ = kv.forward(lm.model, torch.cat([ids, q]), keep_cache=False)
    want = want[ids.shape[0]:]
    stale, _ = kv.forward(lm.model, q, joined, keep_cache=False)
    repaired = kv.selective_recompute(lm.model, joined, ids, range(boundary, ids.shape[0]))
    got, _ = kv.forward(lm.model, q, repaired, keep_cache=False)
    assert (stale - want).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_recompute_edge_cases(tiny_models):
    lm = tiny_models["qwen2"]
    ids, joined, _ = _two_pieces(lm)
    same = kv.selective_recompute(lm.model, joined, ids, [])
    assert torch.equal(same.keys, joined.keys) and torch.equal(same.values, joined.values)
    assert same.keys.data_ptr() != joined.keys.data_ptr()  # a copy
    keys = joined.keys.clone()
    kv.selective_recompute(lm.model, joined, ids, torch.tensor([1, 4]))
    assert torch.equal(joined.keys, keys)  # input untouched
    for bad in ([ids.shape[0]], [-1]):
        with pytest.raises(ValueError, match="out of range"):
            kv.selective_recompute(lm.model, joined, ids, bad)
    with pytest.raises(ValueError, match="tokens but the chunk covers"):
        kv.selective_recompute(lm.model, joined, ids[:-1], [0])


def test_recompute_refuses_attention_that_ignores_masks(tiny_models, monkeypatch):
    lm = tiny_models["gpt2"]
    ids, joined, _ = _two_pieces(lm)
    monkeypatch.setattr(lm.model.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(MotCagError, match="sdpa, eager"):
        kv.selective_recompute(lm.model, joined, ids, [3])


# ------------------------------------------------------------------------------------------------ policies


def test_recompute_count_rounds_half_up_and_keeps_positive_ratios_positive():
    assert [rc.recompute_count(10, r) for r in (0, 0.01, 0.14, 0.15, 0.25, 0.5, 1)] == [0, 1, 1, 2, 3, 5, 10]
    assert rc.recompute_count(0, 0.5) == 0
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            rc.recompute_count(10, bad)


@pytest.mark.parametrize("policy", POSITIONAL_POLICIES)
def test_policies_extremes_and_sizes(policy):
    starts = [0, 6, 10]
    assert rc.recompute_indices(policy, 16, 0.0, starts) == []
    assert rc.recompute_indices(policy, 16, 1.0, starts) == list(range(16))
    for ratio in (0.1, 0.25, 0.5, 0.8):
        got = rc.recompute_indices(policy, 16, ratio, starts)
        assert len(got) == rc.recompute_count(16, ratio) and got == sorted(set(got))
        assert all(0 <= i < 16 for i in got)


def test_start_policy_takes_leading_tokens_of_later_pieces_first():
    starts = [0, 6, 10]
    assert rc.recompute_indices("start", 16, 0.25, starts) == [6, 7, 10, 11]
    assert rc.recompute_indices("start", 16, 0.4, starts) == [6, 7, 8, 10, 11, 12]
    # Only after all later-piece tokens are taken does the first piece (already exact) get any.
    assert rc.recompute_indices("start", 16, 11 / 16, starts) == [0, *range(6, 16)]
    assert rc.recompute_indices("start", 16, 0.125, [3, 9]) == [3, 9]  # a prefix before the first piece


def test_spread_policy_is_evenly_spaced():
    assert rc.recompute_indices("spread", 16, 0.25, [0]) == [2, 6, 10, 14]
    assert rc.recompute_indices("spread", 10, 0.3, [0, 5]) == [1, 5, 8]


def test_end_policy_takes_the_tail_next_to_the_question():
    """The last piece's share selects exactly the last piece, whose recompute equals a single pass
    (test_recomputing_every_token_equals_single_pass)."""
    assert rc.recompute_indices("end", 16, 0.25, [0, 6, 10]) == [12, 13, 14, 15]
    assert rc.recompute_indices("end", 16, 6 / 16, [0, 6, 10]) == list(range(10, 16))
    assert rc.recompute_indices("end", 10, 0.01, [0]) == [9]  # some repair, at the very end


def test_policies_reject_bad_input():
    with pytest.raises(ValueError, match="start, end, spread"):
        rc.recompute_indices("random", 10, 0.5, [0])
    with pytest.raises(ValueError, match="ratio"):
        rc.recompute_indices("start", 10, 2.0, [0])
    for starts in ([0, 5, 5], [0, 12], [4, 2]):
        with pytest.raises(ValueError, match="piece_starts"):
            rc.recompute_indices("start", 10, 0.5, starts)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_kv_is_a_partial_pass_with_prefill_values(tiny_models, family):
    lm = tiny_models[family]
    ids = _ids(lm, PIECES[0] + PIECES[1])
    full = kv.prefill(lm.model, ids, start=4)
    calls = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        for layer in range(lm.layout.layers):
            k, v = kv.layer_kv(lm.model, ids, layer, start=4)
            torch.testing.assert_close(k, full.keys[layer], atol=1e-6, rtol=0)
            torch.testing.assert_close(v, full.values[layer], atol=1e-6, rtol=0)
    finally:
        hook.remove()
    assert calls == []  # the LM head never ran
    with pytest.raises(ValueError, match="does not exist"):
        kv.layer_kv(lm.model, ids, lm.layout.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_deviation_indices_find_the_tokens_that_missed_context(tiny_models, family):
    lm = tiny_models[family]
    ids, joined, boundary = _two_pieces(lm)
    n_second = ids.shape[0] - boundary
    # Piece one is exact, so the most deviating tokens are all in piece two.
    picked = rc.deviation_indices(lm.model, joined, ids, n_second / ids.shape[0])
    assert picked == list(range(boundary, ids.shape[0]))
    small = rc.deviation_indices(lm.model, joined, ids, 0.2, layer=99)  # layer clamps to the last one
    assert len(small) == rc.recompute_count(ids.shape[0], 0.2) and all(i >= boundary for i in small)
    assert rc.deviation_indices(lm.model, joined, ids, 0.0) == []
    assert rc.deviation_indices(lm.model, joined, ids, 1.0) == list(range(ids.shape[0]))
    with pytest.raises(ValueError, match="ratio"):
        rc.deviation_indices(lm.model, joined, ids, -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_under_eager_attention(tiny_models, family, monkeypatch):
    """Eager attention adds the mask to the scores, so the mask must be additive, not bool."""
    lm = tiny_models[family]
    monkeypatch.setattr(lm.model.config, "_attn_implementation", "eager")
    ids, joined, boundary = _two_pieces(lm)
    indices = [boundary, boundary + 2, boundary + 3]
    repaired = kv.selective_recompute(lm.model, joined, ids, indices)
    assert _max_diff(repaired, _sequential_reference(lm.model, joined, ids, indices)) <= ATOL
