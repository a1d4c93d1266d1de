"""The synthetic fact-QA generator follows docs/synthetic-qa.md and is deterministic per seed."""

from __future__ import annotations

import random

import pytest

from mot_cag.data import names
from mot_cag.data.jsonl import read_jsonl, write_jsonl
from mot_cag.data.synthetic import (
    RELATIONS,
    TASKS,
    Fact,
    qa_training_text,
    repeat_training_text,
    synth_dataset,
)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(task):
    kw = {"context_chars": 1500}
    assert synth_dataset(task, 5, 7, **kw) == synth_dataset(task, 5, 7, **kw)
    assert synth_dataset(task, 5, 7, **kw) != synth_dataset(task, 5, 8, **kw)


def test_all_templates_rendered():
    rows = synth_dataset("qa", 300, 0)
    seen = {(r["relation"], r["template"]) for r in rows}
    assert seen == {(rel, t) for rel in RELATIONS for t in ("forward", "inverted")}


def test_templates_and_cue_match_spec():
    f = Fact("Ana Brell", "born_in", "Kolvmar", "forward")
    assert f.sentence() == "Ana Brell was born in Kolvmar."
    assert f.question() == "Where was Ana Brell born?"
    assert f.cue() == "Ana Brell was born in"
    assert Fact("Ana Brell", "born_in", "Kolvmar", "inverted").sentence() == "Kolvmar is the birthplace of Ana Brell."
    assert Fact("Ana Brell", "code", "0123", "forward").cue() == "The access code of Ana Brell is"


@pytest.mark.parametrize("task", ["qa", "closed", "needle", "multikey", "multihop"])
def test_answer_in_context_and_fields(task):
    for r in synth_dataset(task, 20, 3, context_chars=2000):
        assert {"id", "context", "question", "answer", "cue"} <= r.keys()
        assert r["answer"] in r["context"]
        assert "." not in r["answer"] or task == "repeat"
        if task == "closed":
            assert len(r["options"]) == 4 and r["options"][r["answer_index"]] == r["answer"]


def test_forward_cue_precedes_value_in_context():
    for r in synth_dataset("qa", 50, 1, template="forward"):
        assert f"{r['cue']} {r['answer']}." in r["context"]


def test_repeat_rows():
    for r in synth_dataset("repeat", 5, 0):
        assert r["task"] == "repeat" and r["answer"] == r["context"]


def test_long_context_length():
    rows = synth_dataset("needle", 3, 0, context_tokens=1000)  # ~4 chars/token without a tokenizer
    assert all(3600 <= len(r["context"]) <= 4600 for r in rows)
    mk = synth_dataset("multikey", 3, 0, context_chars=3000, n_keys=5)
    assert all(r["context"].count("access code") >= 5 for r in mk)


def _invented(text: str) -> set[str]:
    return {w.strip(".,") for w in text.split() if w[:1].isupper() or w[:1].isdigit()}


def test_heldout_strings_never_in_training_text():
    rng = random.Random(0)
    train = set()
    for _ in range(300):
        train |= _invented(qa_training_text(rng)) | _invented(repeat_training_text(rng))
    rows = synth_dataset("qa", 200, 12345)
    answers = {r["answer"] for r in rows if r["relation"] in ("born_in", "lives_in", "employer", "sibling", "code")}
    assert answers and all(names.split_of(a) == "eval" for a in answers)
    entities = {r["cue"] for r in rows}
    assert entities
    # Whole invented strings of the eval split never appear in training text.
    assert all(names.split_of(a) == "eval" for a in answers)
    train_full = {x for x in train if names.split_of(x) == "train"}
    assert not (answers & train_full)


def test_split_is_a_partition():
    rng = random.Random(5)
    ev = [names.person_name(rng, "eval") for _ in range(50)]
    tr = [names.person_name(rng, "train") for _ in range(50)]
    assert all(names.split_of(x) == "eval" for x in ev) and all(names.split_of(x) == "train" for x in tr)


def test_training_text_format():
    text = qa_training_text(random.Random(1), n_questions=3)
    lines = text.split("\n")
    assert sum(line.startswith("Question: ") for line in lines) == 3
    assert sum(line.startswith("Answer: ") for line in lines) == 3
    assert lines[-1].startswith("Answer: ") and lines[-1].endswith(".")
    doc, rep = repeat_training_text(random.Random(2)).split("\nRepeat: ")
    assert doc == rep


def test_jsonl_roundtrip(tmp_path):
    rows = synth_dataset("closed", 4, 0)
    path = write_jsonl(rows, tmp_path / "sub" / "d.jsonl")
    assert read_jsonl(path) == rows


def test_bad_task():
    with pytest.raises(ValueError, match="Unknown synthetic task"):
        synth_dataset("nope", 1, 0)
