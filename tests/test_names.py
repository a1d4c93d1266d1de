"""The names a user picks from: one definition each, validated where input enters, old spellings understood."""

from __future__ import annotations

import json

import pytest
from clirun import run_cli

from mot_cag.config import PipelineConfig
from mot_cag.errors import MotCagError, StoreError
from mot_cag.names import CONTEXT_MODES, COVERAGES, INJECTIONS, choose
from mot_cag.translate.checkpoint import BUNDLED_DIR, read_config


def test_old_injection_spelling_is_understood_and_context_mode_direct_is_kept():
    assert choose("injection", "direct", INJECTIONS) == "inject-all"
    assert choose("context mode", "direct", CONTEXT_MODES) == "direct"  # the text-reading mode keeps its name
    cfg = PipelineConfig(injection="direct", mode="direct")
    assert (cfg.injection, cfg.mode) == ("inject-all", "direct")
    with pytest.raises(MotCagError, match="inject-all, replay"):
        choose("injection", "sideways", INJECTIONS)
    with pytest.raises(StoreError, match="chunk prefix"):
        choose("chunk prefix", "auto", ("prompt", "none"), StoreError)


def test_translator_files_written_before_the_rename_still_load(tmp_path):
    """The bundled translators' config.json say ``"mode": "direct"``; they read as covering every layer."""
    bundled = sorted(BUNDLED_DIR.glob("*/config.json"))
    olds = [p for p in bundled if json.loads(p.read_text()).get("mode") == "direct"]
    assert olds, "expected bundled translators written with the old key"
    assert read_config(olds[0].parent).coverage == "inject-all"
    data = json.loads(olds[0].read_text())
    data["mode"] = "replay"
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert read_config(tmp_path).coverage == "replay"
    assert set(COVERAGES) == {"inject-all", "replay"}


@pytest.mark.parametrize("option", [["--injection", "replay"], ["--mode", "direct"]])
def test_train_takes_injection_and_its_old_name(tiny_dir, tmp_path, monkeypatch, capsys, option):
    monkeypatch.setenv("MOT_CAG_HOME", str(tmp_path))
    src = str(tiny_dir / "tiny-gpt2")
    code, out, err = run_cli(monkeypatch, capsys, "train", "--source", src, "--target", src, "--steps", "1",
                             "--batch", "1", "--hidden", "16", "--experts", "1", "--eval", "0", "--device", "cpu",
                             "--calibration-tokens", "64", "--json", *option)
    assert code == 0, err
    res = json.loads(out)
    assert res["coverage"] == {"replay": "replay", "direct": "inject-all"}[option[1]]
    assert read_config(res["path"]).coverage == res["coverage"]
