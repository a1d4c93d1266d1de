"""Zoo models, tokenizers, circuit initialisation and the training recipe."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from mot_cag.data.synthetic import synth_dataset
from mot_cag.zoo.circuits import layout, offset_amplitudes
from mot_cag.zoo.models import ZOO, get_spec, model_dir
from mot_cag.zoo.quick_eval import qa_metrics
from mot_cag.zoo.train import (
    TOKENIZER_DIR,
    ZooTrainConfig,
    build_model,
    export_model,
    load_checkpoint,
    load_tokenizer,
    make_card,
    save_checkpoint,
    train,
)

SHIPPED = [n for n in ZOO if (model_dir(n) / "model.safetensors").exists()]


def test_tokenizers_are_distinct():
    toks = {f: AutoTokenizer.from_pretrained(TOKENIZER_DIR / f) for f in ("gpt2", "opt", "qwen2")}
    assert len({len(t) for t in toks.values()}) == 3
    text = "Ana Brell was born in Kolvmar. The access code of Ana Brell is 4829103."
    for tok in toks.values():
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(tok(text, return_offsets_mapping=True)["offset_mapping"]) == len(ids)
    assert toks["opt"](text)["input_ids"][0] == 2  # OPT's BOS </s> is id 2
    assert toks["gpt2"](text)["input_ids"][0] != toks["gpt2"].bos_token_id
    pieces = toks["qwen2"].convert_ids_to_tokens(toks["qwen2"]("4829103")["input_ids"])
    assert pieces == list("4829103")  # Qwen2-style: digits one by one


def test_lp_offsets_have_a_margin():
    import numpy as np

    w, margin = offset_amplitudes(np.geomspace(1.0, 1e-3, 8), max_offset=2, length=512)
    assert margin > 0.05 and abs(w.sum() - 1) < 1e-6 and (w >= -1e-9).all()


@pytest.mark.parametrize("name", list(ZOO))
def test_constructed_previous_token_heads(name):
    spec = get_spec(name)
    tok = load_tokenizer(spec.family)
    model, info = build_model(spec, tok)
    model.config._attn_implementation = "eager"
    ids = torch.randint(10, len(tok), (1, 300))
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions[0][0]  # (heads, T, T)
    offsets = torch.arange(300)[None, 5:] - att[:, 5:].argmax(-1)  # (heads, T-5)
    built = {int(off[0]) for off in offsets if (off == off[0]).all()}
    assert set(spec.prev_offsets) <= built
    assert set(info["layout"]) == set(layout(spec))


def test_checkpoint_roundtrip(tmp_path):
    spec = get_spec("qwen2-mini")
    tok = load_tokenizer(spec.family)
    model, _ = build_model(spec, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    save_checkpoint(tmp_path, model, opt, {"step": 1})
    model2, _ = build_model(spec, tok, seed=1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    assert load_checkpoint(tmp_path, model2, opt2) == {"step": 1}
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.bin"))


def test_export_loads_with_auto_classes(tmp_path):
    spec = get_spec("gpt2-mini")
    tok = load_tokenizer(spec.family)
    model, info = build_model(spec, tok)
    state = {
        "step": 0,
        "wall_s": 0.0,
        "spec": spec.to_dict(),
        "train": {},
        "circuit": info,
        "eval": None,
        "data_seed": 0,
    }
    out = export_model("gpt2-mini", model, tok, make_card("gpt2-mini", state), tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(out).float()
    assert loaded.config.n_positions >= 1024
    assert json.loads((out / "card.json").read_text())["steps"] == 0
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_loads_and_uses_context(name):
    folder = model_dir(name)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    assert model.config.max_position_embeddings >= 1024
    assert sum(f.stat().st_size for f in folder.iterdir()) < 12 * 2**20
    res = qa_metrics(model, tok, synth_dataset("qa", 12, 4242, template="forward", n_entities=3, facts_per_entity=2))
    # Answer-token NLL with the document must be clearly below the NLL without it.
    assert res["direct"]["nll"] < res["none"]["nll"] - 0.5


def test_zoo_size_budget():
    total = sum(f.stat().st_size for n in SHIPPED for f in model_dir(n).iterdir())
    assert total < 40 * 2**20


@pytest.mark.slow
def test_few_training_steps_lower_the_loss(tmp_path):
    lines: list[str] = []
    cfg = ZooTrainConfig(
        steps=50,
        tokens_per_step=512,
        eval_every=10_000,
        ckpt_every=50,
        export_every=10_000,
        eval_n=2,
        warmup=5,
        threads=2,
        lr=3e-3,
    )
    train("qwen2-mini", cfg, runs_dir=tmp_path, export_dir=tmp_path / "export", log=lines.append)
    losses = [
        json.loads(x)["loss"]
        for x in (tmp_path / "qwen2-mini" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    assert losses[-1] < losses[0] - 0.3


def test_exact_match_stop_rule():
    from mot_cag.zoo.quick_eval import _ends_answer

    assert _ends_answer(".", None) and _ends_answer(".\n", None) and _ends_answer("\n", None)
    assert _ends_answer("</s>", "</s>")
    assert not _ends_answer("fish", None) and not _ends_answer(" Bra", None)


# ------------------------------------------------------------------------------------------------ CLI




@pytest.mark.parametrize("command", ["train", "eval"])
def test_zoo_cli_help(monkeypatch, capsys, command):
    code, out, _ = run_cli(monkeypatch, capsys, "zoo", command, "--help")
    assert code == 0 and "--json" in out and ("--steps" in out if command == "train" else "--long-tokens" in out)


@pytest.mark.parametrize(
    "args", [["train", "llama-mini"], ["eval", "llama-mini"], ["train", "qwen2-mini", "--export-only"]]
)
def test_zoo_cli_errors_are_one_line(monkeypatch, capsys, tmp_path, args):
    runs = ["--runs-dir", str(tmp_path)] if args[0] == "train" else []  # an empty runs folder: no checkpoint
    code, out, err = run_cli(monkeypatch, capsys, "zoo", *args, *runs)
    assert code == 1 and out == "" and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert ("checkpoint" in err) if "--export-only" in args else ("llama-mini" in err and "qwen2-mini" in err)


def test_zoo_cli_train_resumes_from_its_checkpoint(monkeypatch, capsys, tmp_path):
    threads = torch.get_num_threads()
    runs, export = tmp_path / "runs", tmp_path / "export"
    tiny = ["--tokens-per-step", "256", "--eval-n", "1", "--threads", "1", "--device", "cpu",
            "--runs-dir", str(runs), "--export-dir", str(export), "--json"]
    try:
        code, out, err = run_cli(monkeypatch, capsys, "zoo", "train", "qwen2-mini", "--steps", "2", *tiny)
        assert code == 0, err
        assert json.loads(out)["step"] == 2 and "start at step 0 -> 2" in err
        code, out, err = run_cli(monkeypatch, capsys, "zoo", "train", "qwen2-mini", "--steps", "3", *tiny)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert json.loads(out)["step"] == 3 and "start at step 2 -> 3" in err
    assert json.loads((runs / "qwen2-mini" / "ckpt" / "state.json").read_text())["step"] == 3
    assert json.loads((export / "card.json").read_text())["steps"] == 3
    steps = [json.loads(x)["step"] for x in (runs / "qwen2-mini" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]  # one evaluation record per run: the second did not start again from 0
