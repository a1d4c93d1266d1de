"""`mot-cag train` and `mot-cag translators` end to end on tiny models (subprocesses, one thread each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(args: list[str], home) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOT_CAG_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mot_cag.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_train_then_list(tiny_dir, tmp_path):
    src, tgt = str(tiny_dir / "tiny-gpt2"), str(tiny_dir / "tiny-qwen2")
    proc = _run(["train", "--source", src, "--target", tgt, "--steps", "2", "--batch", "1", "--hidden", "16",
                 "--experts", "2", "--top-k", "1", "--eval", "2", "--device", "cpu", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert (res["source"], res["target"], res["kind"], res["experts"]) == (src, tgt, "mot", 2)
    assert res["eval"]["inject-all"]["n"] == 2 and res["final"]["step"] == 2
    listed = _run(["translators", "--json"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout) if r["path"] == res["path"]]
    assert len(rows) == 1
    assert {k: rows[0][k] for k in ("source", "target", "kind", "experts", "params")} == \
        {"source": src, "target": tgt, "kind": "mot", "experts": 2, "params": res["params"]}


def test_train_bad_options_are_one_line_errors(tiny_dir, tmp_path):
    src = str(tiny_dir / "tiny-gpt2")
    for extra in (["--kind", "bogus"], ["--mode", "replay", "--window-start", "5"], ["--ce", "0", "--ccl", "0",
                                                                                      "--kl", "0"]):
        proc = _run(["train", "--source", src, "--target", src, "--steps", "1", "--device", "cpu", *extra], tmp_path)
        assert proc.returncode != 0, extra
        assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:"), (extra, proc.stderr)


def test_cli_train_defaults_match_the_library():
    """`mot-cag train` and `TrainConfig` must not drift apart (the CLI repeats the defaults for --help)."""
    import inspect

    from mot_cag.cli import train_cmd
    from mot_cag.translate.train import TrainConfig

    params = inspect.signature(train_cmd).parameters
    lib = TrainConfig()
    for name in ("steps", "batch", "lr", "ce", "ccl", "kl", "init", "seed"):
        assert params[name].default == getattr(lib, name), name
