"""Model registry: zoo names, aliases, Hugging Face ids and local folders, loaded offline-first.

Resolution order for a name: a bundled zoo model, an existing local directory, a real model shipped in an
installed package (:mod:`mot_cag.models.packaged`: converted once into the user's cache on first use), an
alias (``opt-1.3b`` -> ``facebook/opt-1.3b``), then a Hugging Face id looked up in the local HF cache only.
Nothing is ever downloaded; a model that is not on this machine raises :class:`ModelNotFoundError` with one
sentence saying what was looked for, where, how to get it, and what is available.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from mot_cag.errors import ModelNotFoundError, MotCagError
from mot_cag.models import packaged
from mot_cag.models.layout import SUPPORTED_FAMILIES, KVLayout

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo" / "models"

ALIASES: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "opt-125m": "facebook/opt-125m",
    "opt-350m": "facebook/opt-350m",
    "opt-1.3b": "facebook/opt-1.3b",
    "opt-2.7b": "facebook/opt-2.7b",
    "opt-6.7b": "facebook/opt-6.7b",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b-instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
}

Origin = Literal["zoo", "local", "package", "hf-cache"]


@dataclass(frozen=True)
class ModelRef:
    """Where a model name resolved to."""

    name: str
    path: Path
    origin: Origin


def zoo_names() -> list[str]:
    """Names of the bundled zoo models present in this install."""
    if not ZOO_DIR.is_dir():
        return []
    return sorted(p.name for p in ZOO_DIR.iterdir() if (p / "config.json").is_file())


def _hf_cache_lookup(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None
    return Path(path) if (Path(path) / "config.json").is_file() else None


def resolve(name: str, progress: packaged.ConversionProgress | None = None) -> ModelRef:
    """Find a model on this machine.

    A packaged real model that has not been converted yet is converted here (once; tens of seconds), with
    ``progress`` (default: a bar on stderr when it is a terminal).

    Raises:
        ModelNotFoundError: With a one-sentence explanation when it is not here.
    """
    if not name or not name.strip():
        raise ModelNotFoundError("No model name was given; pass a zoo name, an alias, a Hugging Face id or a path.")
    if name in zoo_names():
        return ModelRef(name, ZOO_DIR / name, "zoo")
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(
                f"Directory '{local}' has no config.json; point to a folder saved with save_pretrained."
            )
        return ModelRef(name, local.resolve(), "local")
    real = packaged.lookup(name)
    if real is not None:
        if not packaged.is_converted(real):
            packaged.convert(real, progress or packaged.StderrProgress(real.name))
        return ModelRef(real.name, packaged.model_dir(real), "package")
    repo_id = ALIASES.get(name.lower(), name)
    cached = _hf_cache_lookup(repo_id) if "/" in repo_id else None
    if cached is not None:
        return ModelRef(name, cached, "hf-cache")
    available = ", ".join(zoo_names() + [m.name for m in packaged.PACKAGED.values() if packaged.installed(m)]) or "none"
    alias_note = f" (alias of {repo_id})" if repo_id != name else ""
    hub = "huggingface-cli download " + repo_id if "/" in repo_id else "save it with save_pretrained to a folder"
    raise ModelNotFoundError(
        f"Model '{name}'{alias_note} is not on this machine (looked in the bundled zoo, local paths and the "
        f"Hugging Face cache at {_hf_cache_dir()}, never downloading): fetch it where a hub is reachable "
        f"(`{hub}`) or pass a local folder; available here: {available}."
    )


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return str(HF_HUB_CACHE)
    except Exception:  # noqa: BLE001
        return os.path.expanduser("~/.cache/huggingface/hub")


# ------------------------------------------------------------------------------------------------ loading


@dataclass
class LoadedModel:
    """A model ready to prefill and generate."""

    name: str
    ref: ModelRef
    model: torch.nn.Module
    tokenizer: object
    layout: KVLayout
    fingerprint: str

    @property
    def device(self) -> torch.device:
        if self.model is None:
            return torch.device("cpu")
        return next(self.model.parameters()).device


def fingerprint(path: Path) -> str:
    """Stable identity of a model's weights and tokenizer (16 hex chars).

    Hashes the config, tokenizer files and, for each weight file, its name, size and first and last 4 MiB:
    cheap for multi-GB checkpoints, and any retraining changes it.
    """
    h = hashlib.sha256()
    marker = path / packaged.MARKER
    if marker.is_file():
        # A converted packaged model: the GGUF digest identifies the weights; the conversion time does not.
        h.update(json.loads(marker.read_text()).get("sha256", "").encode())
    for fname in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        f = path / fname
        if f.is_file():
            h.update(fname.encode())
            h.update(f.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(4 << 20))
            if size > 8 << 20:
                fh.seek(-(4 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:16]


def _plain_tokenizer(path: Path):
    """A converted packaged model's tokenizer, built straight from its tokenizer.json.

    ``AutoTokenizer`` also parses the 33 MB tokenizer.json of Gemma3 in Python and deep-copies its added
    tokens (5.2 s here); this path takes 2.1 s and gives the same ids (see packaged._plain_fast_tokenizer).
    """
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((path / "tokenizer_config.json").read_text())
    specials = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **specials)
    template = path / "chat_template.jinja"
    if template.is_file():
        tok.chat_template = template.read_text()
    elif cfg.get("chat_template"):
        tok.chat_template = cfg["chat_template"]
    return tok


def load_config(name: str):
    """Resolve ``name`` and read its config without loading weights."""
    from transformers import AutoConfig

    ref = resolve(name)
    return ref, AutoConfig.from_pretrained(ref.path, trust_remote_code=False)


def load_model(
    name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    weights: bool = True,
) -> LoadedModel:
    """Load a model and its fast tokenizer, offline.

    Args:
        name: Zoo name, alias, Hugging Face id or local folder.
        device: Where the weights go.
        dtype: Weight dtype.
        trust_remote_code: Allow model code from the checkpoint (off unless the user asks).
        weights: ``False`` loads only config, tokenizer and fingerprint (``model`` is ``None``): enough to
            align tokenizers and check a translator's pair without the cost of the weights.

    Raises:
        ModelNotFoundError: The model is not on this machine.
        MotCagError: The family is unsupported or the tokenizer is not a fast tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ref = resolve(name)

    config = AutoConfig.from_pretrained(ref.path, trust_remote_code=trust_remote_code)
    try:
        layout = KVLayout.from_config(config)
    except ValueError as e:
        raise MotCagError(str(e)) from None
    if ref.origin == "package":
        tokenizer = _plain_tokenizer(ref.path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(ref.path, use_fast=True, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise MotCagError(
            f"Model '{name}' has no fast tokenizer (tokenizer.json); mot-cag needs character offsets to align "
            "tokenizers: convert it with transformers' convert_slow_tokenizer and save it beside the model."
        )
    if not weights:
        return LoadedModel(name, ref, None, tokenizer, layout, fingerprint(ref.path))
    model = AutoModelForCausalLM.from_pretrained(
        ref.path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(name, ref, model, tokenizer, layout, fingerprint(ref.path))


# ------------------------------------------------------------------------------------------------ listing


def safetensors_numel(files: list[Path], skip: Callable[[str], bool] = lambda key: False) -> int:
    """Elements of the tensors in safetensors files, read from their headers only (no tensor is loaded).

    Args:
        files: safetensors files; a missing one counts 0.
        skip: names of tensors not to count (e.g. a translator's normalisation buffers).
    """
    total = 0
    for f in files:
        if not f.is_file():
            continue
        with safe_open(str(f), framework="pt") as fh:
            total += sum(math.prod(fh.get_slice(key).get_shape()) for key in fh.keys() if not skip(key))
    return total


def describe(ref: ModelRef) -> dict:
    """The ``mot-cag models --json`` record of one model."""
    from transformers import AutoConfig

    layout = KVLayout.from_config(AutoConfig.from_pretrained(ref.path, trust_remote_code=False))
    return {
        "name": ref.name,
        "family": layout.family,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "params": safetensors_numel(sorted(ref.path.glob("*.safetensors"))),
        "positions": layout.positions,
        "origin": ref.origin,
    }


def _hf_cache_models() -> list[ModelRef]:
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache or unreadable cache: nothing to list
        return []
    refs = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            cfg = Path(rev.snapshot_path) / "config.json"
            if not cfg.is_file():
                continue
            try:
                model_type = json.loads(cfg.read_text()).get("model_type")
            except (OSError, json.JSONDecodeError):
                continue
            if model_type in SUPPORTED_FAMILIES and any(Path(rev.snapshot_path).glob("*.safetensors")):
                alias = next((a for a, r in ALIASES.items() if r == repo.repo_id), repo.repo_id)
                refs.append(ModelRef(alias, Path(rev.snapshot_path), "hf-cache"))
                break
    return refs


def _packaged_record(m: packaged.PackagedModel) -> dict:
    """Listing record of a packaged model: described from its folder once converted, else its install state."""
    if packaged.is_converted(m):
        rec = describe(ModelRef(m.name, packaged.model_dir(m), "package"))
        rec["converted"] = True
        return rec
    return {"name": m.name, "family": None, "layers": None, "kv_heads": None, "head_dim": None, "params": None,
            "positions": None, "origin": "package" if packaged.installed(m) else "not-installed",
            "converted": False, "install": m.pip}


def list_models() -> list[dict]:
    """Every model usable here: the zoo, the packaged real models (installed or not: the record says how to
    install), then supported models in the HF cache."""
    out = []
    for ref in [ModelRef(n, ZOO_DIR / n, "zoo") for n in zoo_names()]:
        try:
            out.append(describe(ref))
        except Exception:  # noqa: BLE001 - a broken folder must not hide the others
            continue
    for m in packaged.PACKAGED.values():
        try:
            out.append(_packaged_record(m))
        except Exception:  # noqa: BLE001
            continue
    for ref in _hf_cache_models():
        try:
            out.append(describe(ref))
        except Exception:  # noqa: BLE001
            continue
    return out
