"""Evaluation: metrics, prompt parsing, report keys of cli.md, and retention arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mot_cag.evaluation.metrics import exact_match, normalize_answer, token_f1
from mot_cag.evaluation.scoring import retention
from mot_cag.prompts import extract_prediction, qa_suffix

MODE_KEYS = {"exact_match", "f1", "accuracy", "token_accuracy", "nll", "kl_to_direct", "retrieval_recall",
             "mean_ttft_s"}


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Violin!") == "violin"
    assert exact_match("the violin", "Violin") == 1.0
    assert exact_match("viola", "violin") == 0.0
    assert token_f1("Ana Brell", "Ana Brell Smith") == pytest.approx(0.8)
    assert token_f1("", "x") == 0.0


def test_prediction_is_cut_at_sentence_end_or_newline():
    assert extract_prediction(" Corvale. Tomas works") == "Corvale"
    assert extract_prediction(" 48213.\nQuestion:") == "48213"
    assert extract_prediction(" 3.14 apples\nx") == "3.14 apples"
    assert qa_suffix("Where was Ana Brell born?", "Ana Brell was born in") == (
        "\nQuestion: Where was Ana Brell born?\nAnswer: Ana Brell was born in")


def test_retention_arithmetic():
    modes = {
        "direct": {"f1": 0.8, "exact_match": 0.8, "accuracy": None, "token_accuracy": None, "nll": 1.0,
                   "kl_to_direct": 0.0},
        "translated": {"f1": 0.4, "exact_match": 0.6, "accuracy": None, "token_accuracy": None, "nll": 2.0,
                       "kl_to_direct": 0.5},
        "none": {"f1": 0.0, "exact_match": 0.0, "accuracy": None, "token_accuracy": None, "nll": 5.0,
                 "kl_to_direct": 2.0},
    }
    r = retention(modes)
    assert r["f1"] == pytest.approx(0.5) and r["exact_match"] == pytest.approx(0.75)
    assert r["accuracy"] is None
    assert r["nll_benefit"] == pytest.approx(0.75)  # (5-2)/(5-1)
    assert r["kl_benefit"] == pytest.approx(0.75)  # 1 - 0.5/2
    assert retention({"direct": modes["direct"]}) is None


@pytest.mark.parametrize("task", ["qa", "closed", "repeat"])
def test_eval_json_keys_direct_and_none(tiny_dir, task):
    proc = subprocess.run(
        [sys.executable, "-m", "mot_cag.cli", "eval", "--dataset", f"synthetic:{task}", "--target",
         str(tiny_dir / "tiny-qwen2"), "--mode", "direct", "--mode", "none", "--limit", "2", "--json",
         "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert {"n", "source", "target", "modes", "retention"} <= set(rep)
    assert rep["n"] == 2 and set(rep["modes"]) == {"direct", "none"}
    for rec in rep["modes"].values():
        assert MODE_KEYS <= set(rec)
        assert rec["nll"] > 0
    assert rep["modes"]["direct"]["kl_to_direct"] == 0.0
    assert rep["modes"]["none"]["kl_to_direct"] > 0.0
    if task == "closed":
        assert rep["modes"]["direct"]["accuracy"] is not None
    if task == "repeat":
        assert 0.0 <= rep["modes"]["direct"]["token_accuracy"] <= 1.0
        assert rep["modes"]["direct"]["exact_match"] is None


def test_eval_bad_inputs_are_one_line_errors(tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    for args in (["--dataset", "synthetic:nope"], ["--dataset", str(tmp_path / "missing.jsonl")],
                 ["--dataset", str(bad)], ["--dataset", "synthetic:qa", "--mode", "sideways"],
                 ["--dataset", "synthetic:qa", "--mode", "translated"]):
        proc = subprocess.run([sys.executable, "-m", "mot_cag.cli", "eval", "--target", str(tiny_dir / "tiny-gpt2"),
                               "--limit", "1", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0, args
        assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:"), (args, proc.stderr)
