"""Pipeline configuration: which source model fills the store, where it lives, how to chunk, embed,
retrieve and answer. Read from TOML (``pipelines/default.toml`` by default); command-line options override.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (a declared dependency there)
    import tomli as tomllib

from mot_cag.errors import MotCagError
from mot_cag.names import (
    CHUNK_PREFIXES,
    CONTEXT_MODES,
    DEFAULT_RECOMPUTE_POLICY,
    INJECTIONS,
    KV_DTYPES,
    RECOMPUTE_POLICIES,
    ChunkPrefix,
    ContextMode,
    Injection,
    KVDtype,
    RecomputePolicy,
    choose,
)

#: The pipeline of a project checkout (relative to the current folder); used when present.
DEFAULT_PIPELINE = Path("pipelines/default.toml")
#: Environment variables that replace a pipeline's setting (a command-line option still wins).
ENV_OVERRIDES = {"MOT_CAG_STORE": "store", "MOT_CAG_DEVICE": "device"}


def parse_window(value: float | str | None) -> float | str:
    """A replay window setting: ``auto`` or a share of the target's layers in (0, 1] (text from the command line
    is converted)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    try:
        if isinstance(value, bool):
            raise ValueError
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise MotCagError(f"The replay window must be auto or a share of the target's layers in (0, 1] (e.g. 0.5), "
                          f"got {value!r}.")
    return share


def user_store() -> Path:
    """The default store outside a project checkout: ``$XDG_DATA_HOME/mot-cag/stores/default`` (XDG_DATA_HOME
    defaults to ``~/.local/share``)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "mot-cag" / "stores" / "default"


@dataclass
class PipelineConfig:
    """One pipeline.

    Attributes:
        source: Model that prefills documents into the store.
        store: Store folder.
        chunk_tokens: Chunk size in source tokens.
        kv_dtype: Stored KV dtype (float16, bfloat16, float32).
        embedder: Sentence-embedding model name or path for retrieval.
        chunk_prefix: What a new store's chunks are prefilled after: ``prompt`` (the source model's prompt
            head, kept once at ask time: chunks look as they will be read), ``none`` (each chunk alone from
            position 0), or ``auto`` (``prompt`` for RoPE models prompted with a chat or completion template,
            i.e. real models; ``none`` for the zoo's synthetic-QA format and absolute-position models).
        top_k: Chunks retrieved per question.
        mode: Default context mode of ``ask``.
        injection: How translated caches enter the target: ``auto`` (``inject-all`` followed by the tail recompute
            for translators of prefixed chunks, the real pairs; ``replay-joint`` for the zoo's), ``inject-all`` (every
            layer translated; old spelling ``direct``), ``replay`` (each chunk replayed by the target) or
            ``replay-joint`` (one replay over all retrieved chunks).
        recompute: Fraction of context tokens recomputed against the whole context (CacheBlend-style
            cross-chunk repair of joined caches; 0 = off), or ``auto``: the measured default of the context's
            kind (:data:`~mot_cag.pipeline.context.AUTO_RECOMPUTE`, 0.35, for a real model's own stored chunks,
            :data:`~mot_cag.pipeline.context.AUTO_RECOMPUTE_TRANSLATED`, 0.5, for inject-all over another real
            model's chunks, 0 for replay injections and the zoo; docs/chunk-caches.md, docs/translators-real.md).
        recompute_policy: Which tokens: ``end`` (default), ``deviation``, ``start`` or ``spread``.
        replay_window: Replay-joint injection: the share of the target's layers, from the top, that take
            translated K/V (the target computes the layers below over the whole context: about ``1 - window``
            of a prefill), or ``auto``: the translator's own window.
        targets: Target models this pipeline is meant for (the demo asks each).
        max_new_tokens: Generation budget of ``ask``.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    """

    source: str = "qwen2-mini"
    store: str = "stores/default"
    chunk_tokens: int = 256
    kv_dtype: KVDtype = "float16"
    embedder: str = "all-MiniLM-L6-v2"
    chunk_prefix: ChunkPrefix = "auto"
    top_k: int = 4
    mode: ContextMode = "translated"
    injection: Injection = "auto"
    recompute: float | str = "auto"
    recompute_policy: RecomputePolicy = DEFAULT_RECOMPUTE_POLICY
    replay_window: float | str = "auto"
    targets: list[str] = field(default_factory=lambda: ["qwen2-mini", "opt-mini", "gpt2-mini"])
    max_new_tokens: int = 48
    device: str = "auto"

    def __post_init__(self) -> None:
        self.mode = choose("pipeline mode", self.mode, CONTEXT_MODES)
        self.injection = choose("pipeline injection", self.injection, INJECTIONS)
        if isinstance(self.recompute, str) and self.recompute.strip().lower() == "auto":
            self.recompute = "auto"
        if self.recompute != "auto":
            given = self.recompute
            try:
                if isinstance(given, bool):
                    raise ValueError
                self.recompute = float(given)  # command-line values arrive as text
            except (TypeError, ValueError):
                self.recompute = -1.0
            if not 0.0 <= self.recompute <= 1.0:
                raise MotCagError(f"Pipeline recompute must be auto or a fraction in [0, 1] (e.g. 0.1), got {given!r}.")
        self.replay_window = parse_window(self.replay_window)
        self.recompute_policy = choose("pipeline recompute_policy", self.recompute_policy, RECOMPUTE_POLICIES)
        self.chunk_prefix = choose("pipeline chunk_prefix", self.chunk_prefix, CHUNK_PREFIXES)
        if self.top_k < 1:
            raise MotCagError(f"Pipeline top_k must be at least 1, got {self.top_k}.")
        if self.chunk_tokens < 8:
            raise MotCagError(f"Pipeline chunk_tokens must be at least 8, got {self.chunk_tokens}.")
        self.kv_dtype = choose("pipeline kv_dtype", self.kv_dtype, KV_DTYPES)

    @classmethod
    def from_file(cls, path: str | Path | None = None) -> PipelineConfig:
        """Read a pipeline TOML, then apply the environment (:data:`ENV_OVERRIDES`).

        ``None`` reads ``$MOT_CAG_PIPELINE`` when set, else ``pipelines/default.toml`` when present (a project
        checkout), else the packaged defaults of this class with the store in the user's data folder
        (:func:`user_store`), so a command run from any folder finds the same store. ``MOT_CAG_STORE`` and
        ``MOT_CAG_DEVICE`` replace the file's ``store`` and ``device`` (command-line
        options, applied afterwards with :meth:`override`, win over both).

        Raises:
            MotCagError: Missing file (when named), bad TOML, or unknown keys.
        """
        return cls._read(path).override(**{key: os.environ.get(var) or None for var, key in ENV_OVERRIDES.items()})

    @classmethod
    def _read(cls, path: str | Path | None) -> PipelineConfig:
        if path is None:
            path = os.environ.get("MOT_CAG_PIPELINE") or None
        if path is None:
            if not DEFAULT_PIPELINE.is_file():
                return cls(store=str(user_store()))
            path = DEFAULT_PIPELINE
        path = Path(path)
        if not path.is_file():
            raise MotCagError(f"Pipeline file {path} does not exist; pass an existing TOML file to --pipeline.")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise MotCagError(f"Pipeline file {path} is not valid TOML ({e}).") from None
        data = data.get("pipeline", data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MotCagError(f"Pipeline file {path} has unknown keys {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}.")
        return cls(**data)

    def override(self, **options) -> PipelineConfig:
        """A copy with the given non-``None`` options replaced (command-line overrides)."""
        data = asdict(self)
        data.update({k: v for k, v in options.items() if v is not None})
        return PipelineConfig(**data)

    def to_toml(self) -> str:
        """TOML text of this config."""
        lines = ["[pipeline]"]
        for k, v in asdict(self).items():
            if isinstance(v, list):
                lines.append(f"{k} = [" + ", ".join(f'"{x}"' for x in v) + "]")
            elif isinstance(v, str):
                lines.append(f'{k} = "{v}"')
            else:
                lines.append(f"{k} = {v}")
        return "\n".join(lines) + "\n"
