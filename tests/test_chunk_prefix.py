"""Chunks prefilled the way they are read (issue [2]): after the prompt head, kept once, with the format's
separator after every piece, recorded by the store and checked at ask time."""

from __future__ import annotations

import shutil

import pytest
import torch

from mot_cag.errors import MotCagError, StoreError
from mot_cag.models import cache as kv
from mot_cag.models.positions import Positioner
from mot_cag.pipeline.context import DirectContext, NativeChunksContext, Piece, Recompute
from mot_cag.pipeline.translation import translated_builder
from mot_cag.prompts import as_tensor, encode, prompt_format

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCS = {"a.txt": "Ana Brell was born in Corvale. The favorite color of Ana Brell is green.",
        "b.txt": "Tomas Reddick works as a baker. The access code of Tomas Reddick is 48213.",
        "c.txt": "Mira Hollen lives in Pastowe. Mira Hollen plays the violin."}


@pytest.fixture(scope="module")
def chat_model_dir(tiny_dir, tmp_path_factory):
    """A copy of the tiny Qwen2 folder whose tokenizer carries a chat template (as a real instruct model's)."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("chat") / "tiny-qwen2-chat"
    shutil.copytree(tiny_dir / "tiny-qwen2", path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_lm(chat_model_dir):
    from mot_cag.models.registry import load_model

    lm = load_model(str(chat_model_dir))
    assert prompt_format(lm).kind == "chat", "the saved template must survive loading"
    return lm


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (root / name).write_text(text + "\n", encoding="utf-8")
    return root


def _ingest(docs, store, source, **kw):
    from mot_cag.ingest import ingest

    return ingest([str(docs)], str(store), source=source, embedder="hash", **kw)


def test_prefill_after_equals_the_rows_of_one_pass(chat_lm):
    model = chat_lm.model
    head = as_tensor(list(prompt_format(chat_lm).head))
    ids = as_tensor(encode(chat_lm.tokenizer, DOCS["a.txt"]))
    whole = kv.prefill(model, torch.cat([head, ids]))
    after = kv.prefill_after(model, ids, kv.prefill(model, head))
    assert after.start == len(head) and after.length == len(ids)
    torch.testing.assert_close(after.keys, whole.keys[:, :, len(head):], rtol=0, atol=1e-5)
    torch.testing.assert_close(after.values, whole.values[:, :, len(head):], rtol=0, atol=1e-5)


def test_new_store_of_a_chat_model_prefills_chunks_after_its_prompt_head(chat_model_dir, chat_lm, docs, tmp_path):
    from mot_cag.store.store import Store

    store = tmp_path / "store"
    _ingest(docs, store, str(chat_model_dir))
    cfg = Store.read_config(store)
    head = prompt_format(chat_lm).head
    assert cfg.chunk_prefix == "prompt" and cfg.prefix_ids == head
    st = Store.open(store)
    assert st.info()["chunk_prefix"] == "prompt" and st.verify().ok
    positioner = Positioner(chat_lm.layout, chat_lm.model.config)
    for row in st.manifest.iter_chunks():
        info = st.chunk_info(row.key)
        want = positioner.reposition(
            kv.prefill_after(chat_lm.model, as_tensor(info.token_ids), kv.prefill(chat_lm.model, as_tensor(head))), 0)
        got = st.load(row.key, dtype=torch.float32)
        assert got.start == 0
        torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=5e-3)  # stored in fp16
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=5e-3)
    st.close()
    again = _ingest(docs, store, str(chat_model_dir))
    assert again.chunks_added == 0  # idempotent under the prefix too


def test_the_zoo_format_keeps_prefix_free_chunks_and_the_choice_is_explicit(tiny_dir, chat_model_dir, docs, tmp_path):
    from mot_cag.store.format import chunk_key
    from mot_cag.store.store import Store

    _ingest(docs, tmp_path / "zoo", str(tiny_dir / "tiny-qwen2"))
    assert Store.read_config(tmp_path / "zoo").chunk_prefix == "none"
    _ingest(docs, tmp_path / "alone", str(chat_model_dir), chunk_prefix="none")
    assert Store.read_config(tmp_path / "alone").prefix_ids == ()
    with pytest.raises(StoreError, match="RoPE"):
        _ingest(docs, tmp_path / "opt", str(tiny_dir / "tiny-opt"), chunk_prefix="prompt")
    # The same tokens after a prefix are other KV: another key.
    assert chunk_key("fp", [1, 2, 3], [7, 8]) != chunk_key("fp", [1, 2, 3])
    assert chunk_key("fp", [1, 2, 3], ()) == chunk_key("fp", [1, 2, 3])


def test_stored_chunks_native_chunks_and_direct_read_the_same_tokens(chat_model_dir, chat_lm, docs, tmp_path):
    from mot_cag.pipeline.retrieval import hits_to_pieces
    from mot_cag.store.store import Store

    _ingest(docs, tmp_path / "store", str(chat_model_dir))
    st = Store.open(tmp_path / "store")
    pieces = hits_to_pieces(st, st.search("Where was Ana Brell born?", k=3))
    off = Recompute(0.0)  # compare the joins themselves, not the repair after them
    direct = DirectContext(chat_lm).build(pieces)
    native = NativeChunksContext(chat_lm, recompute=off).build(pieces)
    stored = translated_builder(chat_lm, chat_lm, chunk_prefix=st.config.prefix_ids, recompute=off).build(pieces)
    assert direct.ids == native.ids == stored.ids
    assert chat_lm.tokenizer.decode(direct.ids).endswith("\n\n")  # every piece ends with the separator
    # Text and separator are tokenized together, as one pass over the whole prompt would.
    assert direct.ids[-len(encode(chat_lm.tokenizer, pieces[-1].text + "\n\n")):] == encode(
        chat_lm.tokenizer, pieces[-1].text + "\n\n")
    assert stored.kv.length == native.kv.length == len(direct.ids)
    # Stored and native chunks are the same computation (the store keeps fp16).
    torch.testing.assert_close(stored.kv.keys, native.kv.keys, rtol=0, atol=5e-3)
    # The first piece after the head is exactly what a single pass computes there.
    n = len(prompt_format(chat_lm).head) + len(encode(chat_lm.tokenizer, pieces[0].text))
    torch.testing.assert_close(native.kv.keys[:, :, :n], direct.kv.keys[:, :, :n], rtol=0, atol=1e-4)
    st.close()


def test_a_store_prefilled_after_another_head_is_refused(chat_lm):
    with pytest.raises(MotCagError, match="new store"):
        translated_builder(chat_lm, chat_lm, chunk_prefix=(1, 2, 3))


def test_prefix_conditioning_needs_rope(tiny_models):
    with pytest.raises(MotCagError, match="absolute positions"):
        NativeChunksContext(tiny_models["opt"], prefixed=True)
    assert NativeChunksContext(tiny_models["qwen2"]).prefixed is False  # the zoo's qa format: chunks alone
    assert NativeChunksContext(tiny_models["qwen2"], prefixed=True).build([Piece("Ana Brell was born in Corvale.")])


def test_recompute_auto_resolves_per_context_kind(chat_lm, tiny_models):
    from mot_cag.config import PipelineConfig
    from mot_cag.pipeline.context import AUTO_RECOMPUTE, Recompute

    assert AUTO_RECOMPUTE > 0
    assert NativeChunksContext(chat_lm).recompute == Recompute(AUTO_RECOMPUTE, "end")  # real models' measured default
    assert Recompute(None).resolved(True) == Recompute(AUTO_RECOMPUTE, "end")
    assert Recompute(None, "deviation").resolved(True) == Recompute(AUTO_RECOMPUTE, "deviation")
    assert Recompute(0.2, "start").resolved(True) == Recompute(0.2, "start")  # an explicit ratio is kept
    assert NativeChunksContext(chat_lm, recompute=Recompute(0.0)).recompute.ratio == 0.0
    assert NativeChunksContext(tiny_models["qwen2"]).recompute.ratio == 0.0  # zoo format: no repair by default
    assert Recompute.parse("auto").ratio is None and Recompute.parse("0.2", "start") == Recompute(0.2, "start")
    with pytest.raises(MotCagError, match="auto or a fraction"):
        Recompute.parse("lots")
    assert PipelineConfig().recompute == "auto" and PipelineConfig(recompute="0.3").recompute == 0.3
    with pytest.raises(MotCagError, match="auto or a fraction"):
        PipelineConfig(recompute="1.5")


def test_prefixed_store_verifies_repairs_and_refuses_foreign_chunks(chat_model_dir, docs, tmp_path):
    from mot_cag.store.format import STORE_FORMAT_PREFIXED, StoreConfig
    from mot_cag.store.store import Store
    from mot_cag.store.verify import check_chunk_file, rebuild_manifest

    store = tmp_path / "store"
    _ingest(docs, store, str(chat_model_dir))
    cfg = Store.read_config(store)
    # Older versions read only format 1: a prefixed store says it is newer instead of being misread as prefix-free.
    assert cfg.format == STORE_FORMAT_PREFIXED and cfg.to_dict()["format"] == STORE_FORMAT_PREFIXED
    st, problems = rebuild_manifest(store)
    assert not problems and st.info()["chunks"] == len(DOCS)  # every chunk file recognised under its prefix
    st.close()
    st = Store.open(store)
    row = next(st.manifest.iter_chunks())
    assert check_chunk_file(st.file(row.key), row.key, st.source, prefix_ids=cfg.prefix_ids) is None
    why = check_chunk_file(st.file(row.key), row.key, st.source, prefix_ids=())
    assert why is not None and "prefix" in why  # a prefix-free store would not adopt it
    st.close()
    # A store.json written before chunk prefixes existed reads as prefix-free, format 1.
    old = cfg.to_dict()
    for k in ("chunk_prefix", "prefix_ids"):
        old.pop(k)
    old["format"] = "mot-cag-store/1"
    assert StoreConfig.from_dict(old).chunk_prefix == "none" and StoreConfig.from_dict(old).format == old["format"]


def test_explicit_chunk_prefix_on_an_existing_store_must_match(chat_model_dir, docs, tmp_path):
    _ingest(docs, tmp_path / "store", str(chat_model_dir))
    with pytest.raises(StoreError, match="keeps its prefix"):
        _ingest(docs, tmp_path / "store", str(chat_model_dir), chunk_prefix="none")


def test_contexts_without_a_store_are_not_treated_as_prefixed(chat_lm):
    builder = translated_builder(chat_lm, chat_lm, chunk_prefix=())  # eval of a dataset's own contexts
    assert builder.prefixed is False and builder.recompute.ratio == 0.0


# ----------------------------------------------------------------------- translators for prefixed stores


def _prefixed_identity(lm):
    """An identity translator lm -> lm marked as trained on chunks prefilled after lm's prompt head."""
    from mot_cag.translate.mot import build_translator

    tr = build_translator(lm, lm, expert="mlp", experts=1, top_k=1, hidden=8).eval()
    tr.config.source_head = tr.config.target_head = list(prompt_format(lm).head)
    return tr


def test_translated_prefixed_store_aligns_text_and_separator_after_the_head(chat_model_dir, chat_lm, docs, tmp_path,
                                                                            monkeypatch):
    """The cross-model path on a prefixed store: source chunks (text + separator, made after the source head)
    are aligned over text + separator and placed after the target's head. With an identity translator on the
    same weights this is exactly the stored-chunk context (the path is forced by treating the pair as two
    models)."""
    import mot_cag.pipeline.translation as translation
    from mot_cag.pipeline.retrieval import hits_to_pieces
    from mot_cag.store.store import Store

    _ingest(docs, tmp_path / "store", str(chat_model_dir))
    st = Store.open(tmp_path / "store")
    pieces = hits_to_pieces(st, st.search("Where was Ana Brell born?", k=3))
    off = Recompute(0.0)
    stored = translated_builder(chat_lm, chat_lm, chunk_prefix=st.config.prefix_ids, recompute=off).build(pieces)
    monkeypatch.setattr(translation, "same_model", lambda a, b: False)
    tr = _prefixed_identity(chat_lm)
    for injection in ("inject-all", "replay-joint"):
        built = translated_builder(chat_lm, chat_lm, tr, injection, recompute=off,
                                   chunk_prefix=st.config.prefix_ids).build(pieces)
        assert built.ids == stored.ids
        if injection == "inject-all":
            torch.testing.assert_close(built.kv.keys, stored.kv.keys, rtol=0, atol=1e-4)
            torch.testing.assert_close(built.kv.values, stored.kv.values, rtol=0, atol=1e-4)
    st.close()


def test_auto_injection_and_repair_per_context_kind(chat_lm, monkeypatch):
    """auto: a model's own prefixed chunks get the tail recompute; another model's prefixed chunks are injected in
    every layer and get it too; a replay gets none unless asked, and chunks prefilled alone keep replay-joint."""
    import mot_cag.pipeline.translation as translation
    from mot_cag.pipeline.context import AUTO_RECOMPUTE, AUTO_RECOMPUTE_TRANSLATED, ReplayJointContext
    from mot_cag.translate.mot import build_translator

    head = prompt_format(chat_lm).head
    assert translated_builder(chat_lm, chat_lm, chunk_prefix=head).recompute.ratio == AUTO_RECOMPUTE
    monkeypatch.setattr(translation, "same_model", lambda a, b: False)
    tr = _prefixed_identity(chat_lm)
    auto = translated_builder(chat_lm, chat_lm, tr, "auto", chunk_prefix=head)
    # Translated chunks get a longer native tail than a model's own chunks (measured: docs/translators-real.md).
    assert AUTO_RECOMPUTE_TRANSLATED > AUTO_RECOMPUTE
    assert not isinstance(auto, ReplayJointContext) and auto.recompute == Recompute(AUTO_RECOMPUTE_TRANSLATED, "end")
    assert translated_builder(chat_lm, chat_lm, tr, "replay-joint", chunk_prefix=head).recompute.ratio == 0.0
    start = Recompute(0.1, "start")
    for injection in ("inject-all", "replay-joint"):
        asked = translated_builder(chat_lm, chat_lm, tr, injection, recompute=start, chunk_prefix=head)
        assert asked.recompute == start
    alone = build_translator(chat_lm, chat_lm, expert="mlp", experts=1, top_k=1, hidden=8).eval()
    zoo_like = translated_builder(chat_lm, chat_lm, alone, "auto", chunk_prefix=())
    assert isinstance(zoo_like, ReplayJointContext) and zoo_like.recompute.ratio == 0.0


def test_translator_and_store_must_agree_on_the_chunk_prefix(chat_lm, monkeypatch):
    import mot_cag.pipeline.translation as translation
    from mot_cag.translate.mot import build_translator

    monkeypatch.setattr(translation, "same_model", lambda a, b: False)
    head = prompt_format(chat_lm).head
    alone = build_translator(chat_lm, chat_lm, expert="mlp", experts=1, top_k=1, hidden=8).eval()
    with pytest.raises(MotCagError, match="trained on chunks prefilled alone.*--chunk-prefix prompt"):
        translated_builder(chat_lm, chat_lm, alone, "direct", chunk_prefix=head)
    prefixed = _prefixed_identity(chat_lm)
    with pytest.raises(MotCagError, match="prefilled alone, but .* after the prompt head"):
        translated_builder(chat_lm, chat_lm, prefixed, "direct", chunk_prefix=())
    with pytest.raises(MotCagError, match="another prompt head"):
        translated_builder(chat_lm, chat_lm, prefixed, "direct", chunk_prefix=(1, 2, 3))
    prefixed.config.target_head = [1, 2]
    with pytest.raises(MotCagError, match="prompt head differs"):
        translated_builder(chat_lm, chat_lm, prefixed, "direct", chunk_prefix=head)
    # A prefix-free store and translator still work together.
    assert translated_builder(chat_lm, chat_lm, alone, "direct", chunk_prefix=()).separated is False


def test_prefixed_training_examples_are_made_after_the_heads(chat_lm):
    """Training examples for prefixed stores: source chunk as ingest stores it, target context after its head;
    a ridge fit on the same model is then near-exact and scores a context benefit near 1."""
    from mot_cag.translate.ridge import fit_ridge_translator
    from mot_cag.translate.train import Heads, TrainConfig, evaluate_translator, example_stream, prepare_example

    heads = Heads.of(chat_lm, chat_lm)
    head = prompt_format(chat_lm).head
    ex = prepare_example(chat_lm, chat_lm, (DOCS["a.txt"], "\nQuestion: Where was Ana Brell born?"), heads=heads)
    ids = encode(chat_lm.tokenizer, DOCS["a.txt"] + heads.separator)
    assert ex.start == len(head) and ex.tgt_ids.tolist() == ids and ex.src_chunk.start == 0
    whole = kv.prefill(chat_lm.model, as_tensor(list(head) + ids))
    torch.testing.assert_close(ex.native_full.keys[:, :, :len(ids)], whole.keys[:, :, len(head):], rtol=0, atol=1e-4)
    cfg = TrainConfig(max_context_tokens=96, calibration_tokens=400, chunk_prefix="prompt", data="documents")
    tr = fit_ridge_translator(chat_lm, chat_lm, example_stream(chat_lm, chat_lm, cfg), tokens=400, ridge_lambda=1e-6)
    assert tr.config.training["calibration"]["key_residual"] < 1e-3
    pairs = [(DOCS["b.txt"], "\nQuestion: What is the access code of Tomas Reddick?\nAnswer: 48213.")]
    score = evaluate_translator(tr, chat_lm, chat_lm, pairs, "direct", heads=heads)
    assert score["n"] == 1 and score["kl_benefit"] > 0.99
    with pytest.raises(ValueError, match="inject-all only"):
        evaluate_translator(tr, chat_lm, chat_lm, pairs, "replay", heads=heads)
