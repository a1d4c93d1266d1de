"""Model registry: aliases, local folders, missing models, listing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mot_cag.errors import ModelNotFoundError
from mot_cag.models import registry


def test_alias_and_missing_model_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(registry, "_hf_cache_dir", lambda: str(tmp_path / "empty-cache"))
    with pytest.raises(ModelNotFoundError) as exc:
        registry.resolve("opt-1.3b")
    msg = str(exc.value)
    assert "facebook/opt-1.3b" in msg and "not on this machine" in msg and "available here" in msg
    assert "\n" not in msg


def test_local_folder_resolves_and_loads(tiny_dir):
    ref = registry.resolve(str(tiny_dir / "tiny-qwen2"))
    assert ref.origin == "local"
    desc = registry.describe(ref)
    assert desc["family"] == "qwen2" and desc["kv_heads"] == 2 and desc["positions"] == "rope"
    assert desc["params"] > 0


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        registry.resolve(str(tmp_path))


def test_fingerprint_is_stable_and_sensitive(tiny_dir):
    a = registry.fingerprint(tiny_dir / "tiny-gpt2")
    assert a == registry.fingerprint(tiny_dir / "tiny-gpt2")
    assert a != registry.fingerprint(tiny_dir / "tiny-opt")


def test_cli_missing_model_is_one_line_error_without_traceback(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "mot_cag.cli", "models", "check", "no-such-model-xyz"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "no-such-model-xyz" in lines[0] and lines[0].startswith("error:")


def test_cli_models_check_and_json(tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "mot_cag.cli", "models", "check", str(tiny_dir / "tiny-opt"),
                           "--json", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["passed"] and res["max_abs_diff"] < 1e-4
    proc = subprocess.run([sys.executable, "-m", "mot_cag.cli", "models", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list)
    for row in rows:
        assert {"name", "family", "layers", "kv_heads", "head_dim", "params", "positions", "origin"} <= set(row)
