"""What a new user trips over (issue [5], first items): --version, `ask -` reading stdin, the top-level
imports, and `ingest --store FILE`."""

from __future__ import annotations

import io
import json
import sys

import pytest
from clirun import run_cli

from mot_cag.errors import MotCagError

DOCS = {"ana.txt": "Ana Brell was born in Corvale. Ana Brell works as a baker.",
        "mira.txt": "Mira Hollen plays the violin. Mira Hollen is employed by Quorvex."}


def test_version(monkeypatch, capsys):
    import mot_cag

    code, out, _ = run_cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"mot-cag {mot_cag.__version__}"


def test_top_level_imports():
    from mot_cag import Asker, Store
    from mot_cag.pipeline.ask import Asker as A
    from mot_cag.store.store import Store as S

    assert Asker is A and Store is S


def test_ask_dash_reads_the_question_from_stdin(tiny_dir, tmp_path, monkeypatch, capsys):
    from mot_cag.ingest import ingest

    for name, text in DOCS.items():
        (tmp_path / name).write_text(text)
    store = tmp_path / "store"
    ingest([tmp_path], store=store, source=str(tiny_dir / "tiny-qwen2"), embedder="hash")
    # Two questions from stdin retrieve their own documents: the question read drove retrieval, not "-".
    for question, doc in (("Who employs Mira Hollen?", "mira.txt"), ("Where was Ana Brell born?", "ana.txt")):
        monkeypatch.setattr(sys, "stdin", io.StringIO(question + "\n"))
        code, out, err = run_cli(monkeypatch, capsys, "ask", "-", "--store", str(store), "--target",
                                 str(tiny_dir / "tiny-qwen2"), "--mode", "direct", "--top-k", "1", "--json",
                                 "--device", "cpu")
        assert code == 0, err
        assert json.loads(out)["chunks"][0]["doc"].endswith(doc)


def test_ingest_into_a_file_is_one_clear_error(tiny_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text(DOCS["ana.txt"])
    target = tmp_path / "not-a-folder"
    target.write_text("precious")
    code, _, err = run_cli(monkeypatch, capsys, "ingest", str(tmp_path / "a.txt"), "--store", str(target),
                           "--source", str(tiny_dir / "tiny-qwen2"))
    assert code != 0 and err.startswith("error:") and "is a file" in err
    assert target.read_text() == "precious"  # nothing lost


def test_piped_output_is_plain_and_never_cut(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert code == 0
    assert "…" not in out and "━" not in out and "│" not in out  # no ellipsis, no box drawing when piped
    names = [line.split()[0] for line in out.splitlines()[1:] if line.strip()]
    assert {"qwen2-mini", "qwen2-small", "smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"} <= set(names)


def test_bundled_zoo_translators_load_for_the_demo():
    """`make demo` translates qwen2-mini's store for opt-mini and gpt2-mini with the bundled translators, whose
    configs predate the per-layer layout fields (Gemma3): they must still load."""
    from mot_cag.models.registry import load_model
    from mot_cag.translate.checkpoint import find_translator, load_translator

    source = load_model("qwen2-mini", weights=False)
    for name in ("opt-mini", "gpt2-mini"):
        target = load_model(name)
        assert load_translator(find_translator("qwen2-mini", name), source, target) is not None


def test_environment_overrides_the_pipeline_and_options_override_the_environment(tmp_path, monkeypatch):
    from mot_cag.config import PipelineConfig

    pipe = tmp_path / "p.toml"
    pipe.write_text('[pipeline]\nstore = "from-file"\ndevice = "cpu"\ntop_k = 3\n', encoding="utf-8")
    monkeypatch.setenv("MOT_CAG_PIPELINE", str(pipe))
    assert PipelineConfig.from_file().store == "from-file" and PipelineConfig.from_file().top_k == 3
    monkeypatch.setenv("MOT_CAG_STORE", "from-env")
    monkeypatch.setenv("MOT_CAG_DEVICE", "cuda")
    cfg = PipelineConfig.from_file()
    assert (cfg.store, cfg.device, cfg.top_k) == ("from-env", "cuda", 3)
    assert cfg.override(store="from-option").store == "from-option"
    monkeypatch.setenv("MOT_CAG_PIPELINE", str(tmp_path / "missing.toml"))
    with pytest.raises(MotCagError, match="does not exist"):
        PipelineConfig.from_file()


def test_stop_sequences_end_the_answer(tiny_dir, tmp_path, monkeypatch, capsys):
    """`ask --stop S` ends the answer before S, as OpenAI's `stop` does; without it the answer runs on."""
    from mot_cag.ingest import ingest
    from mot_cag.pipeline.ask import Asker

    for name, text in DOCS.items():
        (tmp_path / name).write_text(text)
    store = tmp_path / "store"
    ingest([tmp_path], store=store, source=str(tiny_dir / "tiny-qwen2"), embedder="hash")
    asker = Asker(str(store), str(tiny_dir / "tiny-qwen2"), mode="direct", max_new_tokens=16)
    full = asker.ask("Where was Ana Brell born?", top_k=1)
    assert len(full.answer) >= 6, full.answer
    stop = full.answer[len(full.answer) // 2:len(full.answer) // 2 + 2]
    cut = asker.ask("Where was Ana Brell born?", top_k=1, stop=[stop])
    assert cut.answer == full.answer[:full.answer.find(stop)].strip()
    assert cut.extra["completion_tokens"] < full.extra["completion_tokens"]
    code, out, _ = run_cli(monkeypatch, capsys, "ask", "Where was Ana Brell born?", "--store", str(store),
                           "--target", str(tiny_dir / "tiny-qwen2"), "--mode", "direct", "--top-k", "1",
                           "--max-new-tokens", "16", "--stop", stop, "--json")
    assert code == 0 and json.loads(out)["answer"] == cut.answer


def test_eval_plot_without_matplotlib_fails_before_any_work(tiny_dir, monkeypatch, capsys):
    import mot_cag.evaluation.run as run

    called = []
    monkeypatch.setattr(run, "run_eval", lambda *a, **kw: called.append(1))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run_cli(monkeypatch, capsys, "eval", "--dataset", "synthetic:qa", "--target",
                           str(tiny_dir / "tiny-qwen2"), "--limit", "2", "--plot", "scores.png")
    assert code != 0 and "mot-cag[plot]" in err and not called


def test_eval_results_are_printed_when_the_plot_fails(tiny_dir, tmp_path, monkeypatch, capsys):
    import mot_cag.evaluation.report as report

    monkeypatch.setattr(report, "check_plot", lambda path: None)

    def broken(rep, path):
        raise OSError("disk full")

    monkeypatch.setattr(report, "save_plot", broken)
    code, out, err = run_cli(monkeypatch, capsys, "eval", "--dataset", "synthetic:qa", "--target",
                             str(tiny_dir / "tiny-qwen2"), "--mode", "direct", "--limit", "2", "--device", "cpu",
                             "--json", "--plot", str(tmp_path / "p.png"))
    assert code != 0 and "disk full" in err and "results are above" in err
    assert json.loads(out)["n"] == 2  # the evaluation's results were printed before the plot failed


def test_help_shows_choices_and_defaults(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(monkeypatch, capsys, "ask", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "[translated|direct|native-chunks|none]" in text and "[auto|inject-all|replay|replay-joint]" in text
    assert "default: the pipeline's, now 4" in text  # --top-k
    code, out, _ = run_cli(monkeypatch, capsys, "ingest", "--help")
    assert "[float16|bfloat16|float32]" in " ".join(out.split())


def test_default_store_outside_a_checkout_is_the_users_not_the_folders(tmp_path, monkeypatch):
    from mot_cag.config import PipelineConfig

    monkeypatch.chdir(tmp_path)  # no pipelines/default.toml here
    monkeypatch.delenv("MOT_CAG_PIPELINE", raising=False)
    monkeypatch.delenv("MOT_CAG_STORE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert PipelineConfig.from_file(None).store == str(tmp_path / "data" / "mot-cag" / "stores" / "default")
    monkeypatch.setenv("MOT_CAG_STORE", str(tmp_path / "mine"))
    assert PipelineConfig.from_file(None).store == str(tmp_path / "mine")


def test_piece_cache_is_bounded_by_bytes_not_entries(monkeypatch):
    import torch

    from mot_cag.models.cache import KVChunk
    from mot_cag.pipeline.context import LRU

    def chunk(tokens: int) -> KVChunk:  # float32: 2 * 2 * 2 * tokens * 8 * 4 bytes = 256 * tokens
        return KVChunk(torch.zeros(2, 2, tokens, 8), torch.zeros(2, 2, tokens, 8))

    lru = LRU(max_bytes=256 * 100)
    for i in range(3):
        lru.get_or(f"big{i}", lambda: chunk(40))  # 10 KiB each: the third pushes the first out
    assert list(lru) == ["big1", "big2"] and lru.bytes == 2 * 256 * 40
    for i in range(50):
        lru.get_or(f"small{i}", lambda: chunk(1))  # many small entries fit where few large ones do
    assert lru.bytes <= 256 * 100 and sum(k.startswith("small") for k in lru) == 50
    huge = lru.get_or("huge", lambda: chunk(200))  # larger than the bound: returned, not kept
    assert huge.length == 200 and "huge" not in lru
    monkeypatch.setenv("MOT_CAG_CACHE_MB", "2")
    assert LRU().max_bytes == 2 << 20


def test_jsonl_datasets_load_without_the_datasets_package(tmp_path):
    """Local JSONL is read with json: no `datasets` import (1 s and cache files in the home folder before),
    and a malformed line is named."""
    import subprocess

    good = tmp_path / "q.jsonl"
    good.write_text('{"id": "a", "context": "Ana was born in Corvale.", "question": "Where?", "answer": "Corvale"}\n'
                    '\n{"context": "", "question": "Who?", "answer": "Mira"}\n')
    code = ("import sys; from mot_cag.evaluation.datasets import load_examples; "
            f"rows = load_examples({str(good)!r}); "
            "assert [r['id'] for r in rows] == ['a', '1'], rows; "
            "assert 'datasets' not in sys.modules, 'datasets was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from mot_cag.evaluation.datasets import load_examples

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "question": "q", "answer": "a"}\n{"context": oops}\n')
    with pytest.raises(MotCagError, match="line 2"):
        load_examples(str(bad))
