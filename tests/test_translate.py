"""Translators on tiny random models: alignment, shapes, identity, positions, checkpoints, refusal, training."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from mot_cag.errors import TranslatorError
from mot_cag.models.cache import forward, prefill
from mot_cag.translate.alignment import leading_unaligned, overlap_matrix, token_alignment
from mot_cag.translate.checkpoint import find_translator, list_translators, load_translator, save_translator
from mot_cag.translate.inject import translate
from mot_cag.translate.layers import LayerMap
from mot_cag.translate.mot import build_translator
from mot_cag.translate.train import TrainConfig, example_stream, loss_terms, train_translator

FAMILIES = ["gpt2", "opt", "qwen2"]
TEXT = "Ana Brell was born in Corvale. Mira Hollen plays the violin."
CONT = "\nQuestion: Where was Ana Brell born?\nAnswer: Ana Brell was born in"


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- alignment


def test_alignment_identity_for_same_tokenizer(tiny_models):
    m = tiny_models["gpt2"]
    al = token_alignment(m.tokenizer, m.tokenizer, TEXT)
    assert torch.equal(al.src_ids, al.tgt_ids)
    assert torch.equal(al.W, torch.eye(len(al.src_ids)))


def test_tokenizer_fingerprint_is_kept_per_tokenizer_and_follows_added_tokens(tiny_models):
    """Computed once per tokenizer (a large vocabulary costs ~0.4 s to serialise), recomputed after tokens are
    added: a translator fitted before them is then told apart."""
    import copy

    from mot_cag.translate import alignment

    tok = copy.deepcopy(tiny_models["gpt2"].tokenizer)
    fp = alignment.tokenizer_fingerprint(tok)
    assert alignment._FINGERPRINTS[tok][1] == fp == alignment.tokenizer_fingerprint(copy.deepcopy(tok))
    tok.add_tokens(["qqzxnewword"])
    assert alignment.tokenizer_fingerprint(tok) != fp
    assert not alignment.same_tokenizer(tok, tiny_models["gpt2"].tokenizer)


def test_alignment_split_and_merged_tokens():
    text = "abc def"
    src = [(0, 3), (3, 7)]  # "abc", " def"
    split = [(0, 1), (1, 3), (4, 7)]  # "a", "bc", "def" (space dropped)
    W = overlap_matrix(src, split, text)
    torch.testing.assert_close(W, torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    merged = [(0, 7)]  # one token covering both source tokens: 3 visible chars each
    torch.testing.assert_close(overlap_matrix(src, merged, text), torch.tensor([[0.5, 0.5]]))
    partial = [(0, 2), (2, 5), (5, 7)]  # "ab", "c d", "ef": straddles the boundary 1:1
    torch.testing.assert_close(overlap_matrix(src, partial, text)[1], torch.tensor([0.5, 0.5]))


def test_alignment_whitespace_token_and_no_overlap():
    text = "a \nb"
    src = [(0, 1), (1, 3), (3, 4)]  # "a", " \n", "b"
    tgt = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 4)]  # "a", " ", "\n", "b", trailing empty special
    W = overlap_matrix(src, tgt, text)
    assert W[1].tolist() == [0.0, 1.0, 0.0] and W[2].tolist() == [0.0, 1.0, 0.0]  # whitespace-only fallback
    assert W[4].tolist() == [0.0, 0.0, 1.0]  # no overlap, not leading: nearest preceding source token
    torch.testing.assert_close(W.sum(1), torch.ones(5))


def test_alignment_opt_bos_row_is_empty(tiny_models):
    gpt2, opt = tiny_models["gpt2"], tiny_models["opt"]
    al = token_alignment(gpt2.tokenizer, opt.tokenizer, TEXT)
    assert al.W.shape == (len(al.tgt_ids), len(al.src_ids))
    assert al.tgt_ids[0] == opt.tokenizer.bos_token_id and leading_unaligned(al.W) == 1
    torch.testing.assert_close(al.W[1:].sum(1), torch.ones(len(al.tgt_ids) - 1))
    # Reverse direction: the source BOS column gets no weight, every target row is covered.
    back = token_alignment(opt.tokenizer, gpt2.tokenizer, TEXT)
    assert back.W[:, 0].abs().sum() == 0 and leading_unaligned(back.W) == 0
    torch.testing.assert_close(back.W.sum(1), torch.ones(len(back.tgt_ids)))


def test_alignment_source_chunk_without_specials(tiny_models):
    opt = tiny_models["opt"]
    al = token_alignment(opt.tokenizer, opt.tokenizer, TEXT, src_special_tokens=False)
    assert len(al.tgt_ids) == len(al.src_ids) + 1 and leading_unaligned(al.W) == 1
    torch.testing.assert_close(al.W[1:], torch.eye(len(al.src_ids)))


def test_alignment_real_tokenizers_agree_on_shared_words(tiny_models):
    a, b = tiny_models["gpt2"].tokenizer, tiny_models["qwen2"].tokenizer
    al = token_alignment(a, b, TEXT)
    src_tok = a.convert_ids_to_tokens(al.src_ids.tolist())
    tgt_tok = b.convert_ids_to_tokens(al.tgt_ids.tolist())
    for t, tok in enumerate(tgt_tok):
        if tok in src_tok and src_tok.count(tok) == 1 and tgt_tok.count(tok) == 1:
            assert al.W[t, src_tok.index(tok)] == 1.0, tok


# ----------------------------------------------------------------------------------------- layer map


def test_layer_map_defaults_and_window():
    lm = LayerMap.build(4, 3, "replay")
    assert (lm.window_start, lm.window_width) == (2, 1) and lm.target_layers == (2,) and lm.source_layers == (3,)
    direct = LayerMap.build(4, 3, "direct")
    assert direct.target_layers == (0, 1, 2) and direct.source_layers[-1] == 3
    assert LayerMap.build(10, 20, "replay").window_width == 3
    early = LayerMap.build(12, 12, "replay", window_start=0, window_width=4)
    assert early.target_layers == (0, 1, 2, 3) and early.source_layers == (0, 1, 2, 3)
    with pytest.raises(ValueError):
        LayerMap.build(4, 4, "replay", window_start=3, window_width=2)


# -------------------------------------------------------------------------------------- shapes, identity


@pytest.mark.parametrize("src", FAMILIES)
@pytest.mark.parametrize("tgt", FAMILIES)
def test_translate_shapes_every_pair(tiny_models, src, tgt):
    s, t = tiny_models[src], tiny_models[tgt]
    tr = build_translator(s, t, expert="attn", experts=3, top_k=2, hidden=16, heads=2)
    al = token_alignment(s.tokenizer, t.tokenizer, TEXT)
    chunk = prefill(s.model, al.src_ids)
    for injection in ("inject-all", "replay"):
        with torch.no_grad():
            out = translate(tr, chunk, al.W, t, al.tgt_ids, target_start=3, injection=injection)
        lay = t.layout
        assert out.keys.shape == (lay.layers, lay.kv_heads, len(al.tgt_ids), lay.head_dim)
        assert out.values.shape == out.keys.shape and out.start == 3
        assert torch.isfinite(out.keys).all() and torch.isfinite(out.values).all()
    bal = tr.balance()
    assert set(bal) == {"importance_cv2", "load_cv2", "entropy"} and 0.0 <= bal["entropy"] <= 1.0 + 1e-6


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("expert", ["attn", "mlp"])
def test_identity_translator_reproduces_native_answers(tiny_models, fam, expert):
    m = tiny_models[fam]
    al = token_alignment(m.tokenizer, m.tokenizer, TEXT)
    cont = torch.tensor(m.tokenizer(CONT, add_special_tokens=False)["input_ids"])
    native = prefill(m.model, al.tgt_ids)
    native_logits, _ = forward(m.model, cont, native)
    for coverage in ("inject-all", "replay"):
        tr = build_translator(m, m, coverage=coverage, expert=expert, experts=4, top_k=2, hidden=16, heads=2,
                              prev_token=coverage == "replay")
        with torch.no_grad():
            ctx = translate(tr, native, al.W, m, al.tgt_ids)
            logits, _ = forward(m.model, cont, ctx)
        torch.testing.assert_close(logits, native_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), native_logits.argmax(-1))


@pytest.mark.parametrize("fam", FAMILIES)
def test_translation_lands_at_target_positions(tiny_models, fam):
    """A chunk translated for position 11 equals the target's own prefill there (identity pair)."""
    m = tiny_models[fam]
    ids = torch.tensor(m.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    W = torch.eye(len(ids))
    # RoPE sources are un-rotated, so a chunk made at 0 can be placed anywhere; absolute ones carry positions.
    src_start = 0 if m.layout.positions == "rope" else 11
    source = prefill(m.model, ids, start=src_start)
    tr = build_translator(m, m, experts=1, expert="mlp", hidden=16)
    with torch.no_grad():
        out = translate(tr, source, W, m, ids, target_start=11)
    native = prefill(m.model, ids, start=11)
    torch.testing.assert_close(out.keys, native.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.values, native.values, atol=1e-5, rtol=1e-5)


def test_translate_refuses_chunk_of_another_model(tiny_models):
    s, t = tiny_models["gpt2"], tiny_models["qwen2"]
    tr = build_translator(s, t, expert="mlp", experts=1, hidden=16)
    al = token_alignment(s.tokenizer, t.tokenizer, TEXT)
    wrong = prefill(tiny_models["opt"].model, al.src_ids)
    with pytest.raises(TranslatorError, match="mot-cag train"):
        translate(tr, wrong, al.W, t, al.tgt_ids)
    replay_only = build_translator(s, t, coverage="replay", expert="mlp", experts=1, hidden=16)
    with pytest.raises(TranslatorError, match="replay"):
        translate(replay_only, prefill(s.model, al.src_ids), al.W, t, al.tgt_ids, injection="inject-all")


# ---------------------------------------------------------------------------------- checkpoints, listing


def test_checkpoint_round_trip_and_listing(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOT_CAG_HOME", str(tmp_path / "home"))
    s, t = tiny_models["opt"], tiny_models["qwen2"]
    tr = build_translator(s, t, expert="attn", experts=3, top_k=2, hidden=16, heads=2)
    with torch.no_grad():  # make weights and calibration stats non-trivial so the round trip is meaningful
        for name, p in itertools.chain(tr.named_parameters(), tr.named_buffers()):
            if "inv_freq" not in name:
                p.add_(torch.rand_like(p) * 0.01)
    from mot_cag.translate.checkpoint import user_dir

    path = save_translator(tr, user_dir() / "pair")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "translator.safetensors"]
    assert json.loads((path / "config.json").read_text())["source"] == s.name
    loaded = load_translator(path, source=s, target=t)
    assert loaded.config.to_dict() == tr.config.to_dict()
    al = token_alignment(s.tokenizer, t.tokenizer, TEXT)
    chunk = prefill(s.model, al.src_ids)
    with torch.no_grad():
        a = translate(tr.eval(), chunk, al.W, t, al.tgt_ids)
        b = translate(loaded, chunk, al.W, t, al.tgt_ids)
    torch.testing.assert_close(a.keys, b.keys)
    torch.testing.assert_close(a.values, b.values)
    rows = [r for r in list_translators() if r["path"].startswith(str(tmp_path))]  # bundled ones may exist too
    assert [r["path"] for r in rows] == [str(path)]
    row = rows[0]
    assert set(row) >= {"source", "target", "kind", "experts", "params", "path"}
    assert row["params"] == tr.parameter_count()
    assert (row["kind"], row["experts"]) == ("mot", 3)
    assert find_translator(s.name, t.name) == path


def test_wrong_pair_is_refused(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOT_CAG_HOME", str(tmp_path / "home"))
    s, t, other = tiny_models["gpt2"], tiny_models["opt"], tiny_models["qwen2"]
    path = save_translator(build_translator(s, t, expert="mlp", experts=1, hidden=16), tmp_path / "tr")
    with pytest.raises(TranslatorError, match=rf"mot-cag train --source {s.name} --target {other.name}"):
        load_translator(path, source=s, target=other)
    with pytest.raises(TranslatorError, match="source"):
        load_translator(path, source=other, target=t)
    with pytest.raises(TranslatorError, match=rf"mot-cag train --source {other.name} --target {t.name}"):
        find_translator(other.name, t.name)


# ----------------------------------------------------------------------------------------- ridge, train


@pytest.mark.parametrize("prev_token", [False, True])
def test_ridge_baseline_same_model_is_near_exact(tiny_models, prev_token):
    from mot_cag.translate.ridge import calibrate, fit_ridge_translator

    m = tiny_models["qwen2"]
    cfg = TrainConfig(max_context_tokens=96, calibration_tokens=600)
    if prev_token:  # the previous-token regressors must not disturb an exact fit
        tr = build_translator(m, m, expert="linear", experts=1, top_k=1, prev_token=True, kind="ridge").eval()
        summary = calibrate(tr, example_stream(m, m, cfg), 600, fit=True, ridge_lambda=1e-6)
    else:
        tr = fit_ridge_translator(m, m, example_stream(m, m, cfg), tokens=600, ridge_lambda=1e-6)
        summary = tr.config.training["calibration"]
    assert tr.config.kind == "ridge" and summary["key_residual"] < 1e-3
    al = token_alignment(m.tokenizer, m.tokenizer, TEXT)
    native = prefill(m.model, al.tgt_ids)
    with torch.no_grad():
        out = translate(tr, native, al.W, m, al.tgt_ids)
    err = (out.keys - native.keys).pow(2).mean() / native.keys.var()
    assert err < 1e-3


def test_loss_terms_are_zero_for_identity_pair(tiny_models):
    m = tiny_models["opt"]
    tr = build_translator(m, m, expert="mlp", experts=2, hidden=16)
    ex = next(iter(example_stream(m, m, TrainConfig(max_context_tokens=64, random_start=0.0, plain_chunk=0.0))))
    with torch.no_grad():
        terms = loss_terms(tr, ex, m)
    assert float(terms["ccl"]) < 1e-8 and float(terms["kl"]) < 1e-8 and float(terms["ce"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("init", ["identity", "ridge"])
def test_a_few_training_steps_reduce_the_loss(tiny_models, init):
    s, t = tiny_models["gpt2"], tiny_models["qwen2"]
    torch.manual_seed(0)
    tr = build_translator(s, t, expert="attn", experts=2, top_k=1, hidden=32, heads=2)
    cfg = TrainConfig(steps=30, batch=2, lr=3e-3, warmup=3, ce=0.0, ccl=1.0, kl=1.0, init=init,
                      calibration_tokens=400, max_context_tokens=64, log_every=5, seed=1)
    held = list(itertools.islice(example_stream(s, t, cfg, seed=777), 4))

    def held_loss() -> float:
        with torch.no_grad():
            return sum(float(loss_terms(tr, ex, t)["ccl"]) for ex in held) / len(held)

    from mot_cag.translate.ridge import calibrate

    # Same calibration train_translator starts from, so "before" is the untrained starting point.
    calibrate(tr, example_stream(s, t, cfg, seed=cfg.seed + 10_000), cfg.calibration_tokens, fit=init == "ridge")
    before = held_loss()
    summary = train_translator(tr, s, t, cfg)
    after = held_loss()
    # From identity there is much to learn; from the closed-form ridge optimum training must still help.
    assert after < (0.9 if init == "identity" else 1.0) * before, (before, after)
    assert summary["history"][-1]["step"] == 30 and "importance_cv2" in summary["history"][-1]


def test_retrained_model_warns_or_is_refused_when_strict(tiny_models, tmp_path):
    from dataclasses import replace

    s, t = tiny_models["gpt2"], tiny_models["opt"]
    path = save_translator(build_translator(s, t, expert="mlp", experts=1, hidden=16), tmp_path / "tr")
    retrained = replace(t, fingerprint="0" * 16)
    with pytest.warns(UserWarning, match="stale"):
        load_translator(path, source=s, target=retrained)
    with pytest.raises(TranslatorError, match="weights differ"):
        load_translator(path, source=s, target=retrained, strict=True)


def test_half_checkpoint_is_smaller_and_close(tiny_models, tmp_path):
    s, t = tiny_models["qwen2"], tiny_models["gpt2"]
    tr = build_translator(s, t, expert="mlp", experts=2, hidden=16).eval()
    full = save_translator(tr, tmp_path / "full")
    half = save_translator(tr, tmp_path / "half", half=True)
    size = lambda p: (p / "translator.safetensors").stat().st_size  # noqa: E731
    assert size(half) < 0.6 * size(full)
    loaded = load_translator(half, s, t)
    assert loaded.dtype == torch.float32
    al = token_alignment(s.tokenizer, t.tokenizer, TEXT)
    chunk = prefill(s.model, al.src_ids)
    with torch.no_grad():
        a, b = translate(tr, chunk, al.W, t, al.tgt_ids), translate(loaded, chunk, al.W, t, al.tgt_ids)
    torch.testing.assert_close(a.keys, b.keys, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fam", FAMILIES)
def test_token_features_keep_identity_and_fit_exactly(tiny_models, fam):
    """Target-embedding side features start at zero weight (identity kept) and the ridge still fits exactly."""
    from mot_cag.translate.ridge import calibrate

    m = tiny_models[fam]
    tr = build_translator(m, m, expert="mlp", experts=2, hidden=16, token_features=True, prev_token=2).eval()
    assert tr.config.token_features == m.model.get_input_embeddings().weight.shape[1]
    al = token_alignment(m.tokenizer, m.tokenizer, TEXT)
    native = prefill(m.model, al.tgt_ids)
    with torch.no_grad():
        out = translate(tr, native, al.W, m, al.tgt_ids)
    torch.testing.assert_close(out.keys, native.keys, atol=1e-5, rtol=1e-5)
    # Source chunks with the target's own specials and positions, so an exact map exists.
    cfg = TrainConfig(max_context_tokens=64, random_start=0.0, plain_chunk=0.0)
    summary = calibrate(tr, example_stream(m, m, cfg), 300, fit=True, ridge_lambda=1e-6, target=m)
    assert summary["key_residual"] < 1e-3 and summary["value_residual"] < 1e-3
    with torch.no_grad():
        out = translate(tr, native, al.W, m, al.tgt_ids)
    assert (out.values - native.values).pow(2).mean() < 1e-3 * native.values.var()


def test_token_rank_projects_embeddings_onto_their_principal_directions(tiny_models, tmp_path):
    """A low-rank token feature: the projection is orthonormal after calibration, the side features shrink to
    the rank, the fit stays exact on the identity pair, and the projection survives a save and load."""
    from mot_cag.translate.checkpoint import load_translator, save_translator
    from mot_cag.translate.ridge import calibrate

    m = tiny_models["qwen2"]
    width = m.model.get_input_embeddings().weight.shape[1]
    tr = build_translator(m, m, expert="linear", experts=1, top_k=1, kind="ridge", token_features=True,
                          prev_token=1, token_rank=4).eval()
    assert tr.config.token_width == 4 and tr.config.side_features == 8 and width > 4
    cfg = TrainConfig(max_context_tokens=64, random_start=0.0, plain_chunk=0.0)
    summary = calibrate(tr, example_stream(m, m, cfg), 300, fit=True, ridge_lambda=1e-6, target=m)
    p = tr.emb_proj
    torch.testing.assert_close(p.T @ p, torch.eye(4), atol=1e-4, rtol=0)
    assert not torch.allclose(p, torch.eye(width, 4))  # fitted, not the initial value
    assert summary["key_residual"] < 1e-3
    loaded = load_translator(save_translator(tr, tmp_path / "tr"), m, m)
    torch.testing.assert_close(loaded.emb_proj, p)
