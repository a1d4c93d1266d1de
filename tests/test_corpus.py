"""The held-out corpus generator: spec-format documents, one answer per question, deterministic, held out."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest
from clirun import run_cli

from mot_cag.data import names
from mot_cag.data.corpus import CorpusConfig, doc_token_lengths, make_corpus, write_corpus
from mot_cag.data.jsonl import read_jsonl
from mot_cag.data.synthetic import RELATIONS, WORDS
from mot_cag.errors import MotCagError


@pytest.fixture(scope="module")
def corpus():
    return make_corpus()


def test_same_seed_same_files(tmp_path):
    cfg = CorpusConfig(docs=6, questions=9, seed=3)
    write_corpus(make_corpus(cfg), tmp_path / "a")
    write_corpus(make_corpus(cfg), tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 6 + 2
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    other = make_corpus(CorpusConfig(docs=6, questions=9, seed=4))
    assert [d.text for d in other.docs] != [d.text for d in make_corpus(cfg).docs]


def test_documents_follow_the_spec(corpus):
    facts = [f for d in corpus.docs for f in d.facts]
    assert {(f.relation, f.template) for f in facts} == {(r, t) for r in RELATIONS for t in ("forward", "inverted")}
    for d in corpus.docs:
        title, body = d.text.split("\n", 1)
        assert title.endswith(".") and not any(f.entity in title for f in d.facts)
        assert all(f.sentence() in body for f in d.facts) and 10 <= len(d.facts) <= 14
        assert len(body) == sum(len(f.sentence()) + 1 for f in d.facts) - 1  # nothing but the facts
        assert len({f.entity for f in d.facts}) >= 3  # several entities per document


def test_one_answer_per_question_in_the_corpus(corpus):
    people = [f.entity for d in corpus.docs for f in {f.entity: f for f in d.facts}.values()]
    people += [f.value for d in corpus.docs for f in d.facts if RELATIONS[f.relation].kind == "person"]
    assert len(people) == len(set(people))
    assert not any(a != b and b.startswith(a) for a in people for b in people)
    by_name = {d.name: d for d in corpus.docs}
    for q in corpus.questions:
        [fact] = [f for f in by_name[q["doc"]].facts if f.question() == q["question"]]
        assert [d.name for d in corpus.docs if fact.entity in d.text] == [q["doc"]]
        assert (fact.value, fact.cue(), fact.template) == (q["answer"], q["cue"], q["template"])
        assert q["context"] == "" and q["relation"] == fact.relation


def test_questions_spread_over_documents_and_templates(corpus):
    per_doc = Counter(q["doc"] for q in corpus.questions)
    assert len(per_doc) == len(corpus.docs) and max(per_doc.values()) <= 2
    assert Counter(q["template"] for q in corpus.questions) == {"forward": 30, "inverted": 30}
    assert len({q["id"] for q in corpus.questions}) == len(corpus.questions)


def test_invented_strings_are_held_out(corpus):
    for d in corpus.docs:
        for f in d.facts:
            assert names.split_of(f.entity) == "eval"
            if RELATIONS[f.relation].kind not in WORDS:
                assert names.split_of(f.value) == "eval", f


def test_default_documents_fill_about_one_chunk():
    from mot_cag.models.registry import load_model

    lengths = doc_token_lengths(make_corpus(), load_model("qwen2-mini", weights=False).tokenizer)
    assert 170 <= statistics.fmean(lengths) <= 230 and min(lengths) >= 120 and max(lengths) <= 270


def test_bad_settings_are_user_errors():
    with pytest.raises(MotCagError, match="questions"):
        CorpusConfig(docs=2, questions=100)
    with pytest.raises(MotCagError, match="MIN-MAX"):
        CorpusConfig(facts_min=9, facts_max=3)




def test_cli_writes_refuses_and_forces(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "corpus"
    args = ["data", "corpus", str(folder), "--docs", "5", "--questions", "7", "--facts-per-doc", "6-8"]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert {"docs", "questions", "dir", "tokens", "doc_tokens"} <= set(summary)
    assert (summary["docs"], summary["questions"]) == (5, 7)
    assert sorted(p.name for p in (folder / "docs").iterdir()) == [f"doc-00{i}.txt" for i in range(5)]
    rows = read_jsonl(folder / "questions.jsonl")
    assert len(rows) == 7 and all((folder / "docs" / r["doc"]).is_file() for r in rows)
    assert json.loads((folder / "corpus.json").read_text())["seed"] == 7311

    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 1 and out == "" and err.startswith("error: ") and "--force" in err
    assert len(err.strip().splitlines()) == 1
    (folder / "docs" / "stale.txt").write_text("old\n")
    code, out, err = run_cli(monkeypatch, capsys, *args[:3], "--docs", "3", "--questions", "4", "--force")
    assert code == 0 and "3 documents" in out and len(list(Path(folder / "docs").iterdir())) == 3
