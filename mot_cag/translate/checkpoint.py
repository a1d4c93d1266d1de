"""Translator files: ``translator.safetensors`` (weights and calibration buffers) + ``config.json``.

A translator directory is self-describing: its ``config.json`` names the pair, both layouts, both tokenizer
fingerprints and both model fingerprints, the layer map, the experts and how it was trained. Translators are
found by reading those files, never by parsing directory names. Search order: the user directory
(``$MOT_CAG_HOME/translators``, default ``~/.cache/mot-cag/translators``), then the bundled
``mot_cag/zoo/translators``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mot_cag.errors import TranslatorError
from mot_cag.models.registry import safetensors_numel
from mot_cag.translate.mot import Translator
from mot_cag.translate.spec import TranslatorConfig

WEIGHTS = "translator.safetensors"
CONFIG = "config.json"
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "zoo" / "translators"


def user_dir() -> Path:
    """Where ``mot-cag train`` saves translators by default."""
    home = os.environ.get("MOT_CAG_HOME")
    base = Path(home).expanduser() if home else Path("~/.cache/mot-cag").expanduser()
    return base / "translators"


def search_dirs() -> list[Path]:
    """Directories searched for translators, in priority order."""
    return [user_dir(), BUNDLED_DIR]


def pair_dirname(source: str, target: str, suffix: str = "") -> str:
    """A filesystem-safe directory name for a pair (only a label: loading reads the config)."""
    def clean(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).name if os.sep in name else name).strip("-") or "model"

    return f"{clean(source)}__{clean(target)}" + (f"__{suffix}" if suffix else "")


def save_translator(translator: Translator, directory: str | Path, half: bool = False) -> Path:
    """Write weights and config into ``directory`` (created). Returns the directory.

    Args:
        translator: The translator.
        directory: Output folder.
        half: Store the weights as float16 (half the size; calibration buffers stay float32). Loading
            always returns a float32 translator.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    params = {name for name, _ in translator.named_parameters()}
    state = {k: v.detach().contiguous().cpu().to(torch.float16 if half and k in params else torch.float32)
             for k, v in translator.state_dict().items()}
    meta = {"format": "mot-cag-translator", "source": translator.config.source, "target": translator.config.target}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path / WEIGHTS)
    (path / CONFIG).write_text(json.dumps(translator.config.to_dict(), indent=2) + "\n")
    return path


def read_config(directory: str | Path) -> TranslatorConfig:
    """Read a translator's config without loading weights."""
    path = Path(directory) / CONFIG
    try:
        return TranslatorConfig.from_dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise TranslatorError(f"'{path}' is not a readable translator config ({e}); retrain it with "
                              "`mot-cag train`.") from None


def _names_match(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_pair(config: TranslatorConfig, source=None, target=None, strict: bool = False) -> None:
    """Refuse a translator used with models it was not made for.

    Another cache layout or tokenizer means another model: refused. The same architecture and tokenizer with
    different weights (a retrained zoo model of the same name) is the same pair, but the translator is stale:
    a warning by default, refused with ``strict``.

    Args:
        config: The translator's config.
        source: Source :class:`~mot_cag.models.registry.LoadedModel` (or ``None`` to skip).
        target: Target loaded model (or ``None`` to skip).
        strict: Also require the exact weights (model fingerprints).

    Raises:
        TranslatorError: Naming the pair it was made for and how to train the right one.
    """
    from mot_cag.translate.alignment import tokenizer_fingerprint

    src_name = source.name if source is not None else config.source
    tgt_name = target.name if target is not None else config.target
    hint = (f"translator {config.source} -> {config.target} cannot translate {src_name} -> {tgt_name}; "
            f"train one with `mot-cag train --source {src_name} --target {tgt_name}`.")
    for role, lm, layout, tok, fp in (
        ("source", source, config.source_layout, config.source_tokenizer, config.source_fingerprint),
        ("target", target, config.target_layout, config.target_tokenizer, config.target_fingerprint),
    ):
        if lm is None:
            continue
        have = json.loads(json.dumps(lm.layout.to_dict()))  # as saved: tuples become lists
        # Keys a translator saved before they existed (Gemma3's per-layer fields) read as unset (None).
        if any(have.get(k) != layout.get(k) for k in set(have) | set(layout)):
            raise TranslatorError(f"The {role} cache layout differs: {hint}")
        if tok and tokenizer_fingerprint(lm.tokenizer) != tok:
            raise TranslatorError(f"The {role} tokenizer differs: {hint}")
        if fp and lm.fingerprint != fp:
            msg = f"The {role} model's weights differ from those it was trained with: {hint}"
            if strict:
                raise TranslatorError(msg)
            warnings.warn(msg.replace("cannot translate", "may be stale for"), stacklevel=3)


def load_translator(
    directory: str | Path,
    source=None,
    target=None,
    device: torch.device | str | None = None,
    strict: bool = False,
) -> Translator:
    """Load a translator, refusing the wrong pair.

    Args:
        directory: A translator directory (``config.json`` + ``translator.safetensors``).
        source: Source loaded model to check against (optional).
        target: Target loaded model to check against (optional; also sets the default device).
        device: Where to put it (default: the target's device, else CPU).
        strict: Refuse (rather than warn about) models whose weights changed since training.

    Raises:
        TranslatorError: Missing/damaged files or the wrong pair.
    """
    path = Path(directory)
    config = read_config(path)
    check_pair(config, source, target, strict=strict)
    if not (path / WEIGHTS).is_file():
        raise TranslatorError(f"'{path}' has no {WEIGHTS}; retrain it with "
                              f"`mot-cag train --source {config.source} --target {config.target}`.")
    translator = Translator(config)
    state = load_file(str(path / WEIGHTS))
    # RoPE frequency buffers may differ in length from the default (partial rotary): take the saved ones.
    for name in ("src_inv_freq", "tgt_inv_freq"):
        if name in state:
            setattr(translator, name, state[name])
    try:
        translator.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise TranslatorError(f"'{path}' does not match its config ({str(e).splitlines()[0]}); retrain it with "
                              f"`mot-cag train --source {config.source} --target {config.target}`.") from None
    if device is None:
        device = target.device if target is not None else "cpu"
    return translator.to(device).eval()


def _candidates() -> list[Path]:
    out = []
    for base in search_dirs():
        if base.is_dir():
            out.extend(sorted(p.parent for p in base.glob(f"*/{CONFIG}")))
    return out


def list_translators() -> list[dict]:
    """Every translator found, as ``mot-cag translators --json`` records.

    Keys: ``source``, ``target``, ``kind``, ``experts``, ``params``, ``path``, plus ``coverage`` and ``expert``.
    """
    rows = []
    for path in _candidates():
        try:
            cfg = read_config(path)
        except TranslatorError:
            continue
        rows.append({"source": cfg.source, "target": cfg.target, "kind": cfg.kind, "experts": cfg.experts,
                     "params": safetensors_numel([path / WEIGHTS], _is_buffer), "path": str(path),
                     "coverage": cfg.coverage, "expert": cfg.expert})
    return rows


_BUFFERS = {"in_mean", "in_std", "out_mean", "out_std", "emb_mean", "emb_std", "src_inv_freq", "tgt_inv_freq"}


def _is_buffer(key: str) -> bool:
    """Normalisation and RoPE buffers are saved with the weights but are not trained parameters."""
    return key.rsplit(".", 1)[-1] in _BUFFERS


def find_translator(source: str, target: str, kind: str | None = None, injection: str | None = None) -> Path:
    """The directory of a translator for (source, target), matched by the names in the configs.

    Args:
        source: Source model name (as given to ``load_model``).
        target: Target model name.
        kind: Prefer this kind (``mot``, ``single``, ``ridge``); default prefers ``mot``, then ``single``.
        injection: Require a translator able to inject this way (``replay`` is possible for every translator).

    Raises:
        TranslatorError: None found, naming where it looked and the command that trains one.
    """
    order = {"mot": 0, "single": 1, "ridge": 2}
    found = []
    for path in _candidates():
        try:
            cfg = read_config(path)
        except TranslatorError:
            continue
        if not (_names_match(cfg.source, source) and _names_match(cfg.target, target)):
            continue
        if kind is not None and cfg.kind != kind:
            continue
        if injection == "inject-all" and cfg.coverage != "inject-all":
            continue
        found.append((order.get(cfg.kind, 3), path))
    if not found:
        where = ", ".join(str(d) for d in search_dirs())
        what = f"{kind} translator" if kind else "translator"
        raise TranslatorError(f"No {what} for {source} -> {target} (looked in {where}); train one with "
                              f"`mot-cag train --source {source} --target {target}`.")
    return sorted(found, key=lambda x: x[0])[0][1]
