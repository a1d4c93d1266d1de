"""Shared fixtures: tiny models of each family, saved once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny  # noqa: E402

FAMILIES = ["gpt2", "opt", "qwen2"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny-models")
    for fam in FAMILIES:
        tiny.build(fam, root / f"tiny-{fam}")
    return root


@pytest.fixture(scope="session")
def tiny_models(tiny_dir):
    from mot_cag.models.registry import load_model

    torch.manual_seed(0)
    return {fam: load_model(str(tiny_dir / f"tiny-{fam}")) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """A tiny random Gemma3 (sliding-window + full layers with different RoPE bases), loaded."""
    from mot_cag.models.registry import load_model

    path = tiny.build("gemma3", tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3")
    return load_model(str(path))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: the CI box has 2 shared cores, and oversubscribed intra-op threads make
    small-model tests several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
