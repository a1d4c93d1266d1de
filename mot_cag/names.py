"""The names a user chooses from, each defined once, and the one check that turns a typed name into a known one.

Three words that were once all "mode" are kept apart here:

- a **context mode** says what the target answers from (translated caches, the text itself, its own chunk
  caches, nothing);
- an **injection** says how translated caches enter the target (every layer injected, a window replayed per
  chunk, or one replay over the joined context);
- a **translator coverage** is the injection a translator was trained for (``inject-all`` covers every target
  layer and can also replay; ``replay`` covers only the window).

Every entry point (pipeline TOML, command line, HTTP request, Python call) validates with :func:`choose`, which
also accepts the old spelling ``direct`` for the injection ``inject-all``.
"""

from __future__ import annotations

from typing import Literal, get_args

from mot_cag.errors import MotCagError

ContextMode = Literal["translated", "direct", "native-chunks", "none"]
Injection = Literal["auto", "inject-all", "replay", "replay-joint"]
Coverage = Literal["inject-all", "replay"]
RecomputePolicy = Literal["deviation", "start", "end", "spread"]
#: Recompute policies that choose tokens from positions alone (``deviation`` needs the model's K/V).
PositionalPolicy = Literal["start", "end", "spread"]
ChunkPrefix = Literal["auto", "prompt", "none"]
#: What a store records: ``auto`` is resolved before a store is made.
StoredChunkPrefix = Literal["prompt", "none"]
KVDtype = Literal["float16", "bfloat16", "float32"]

CONTEXT_MODES: tuple[str, ...] = get_args(ContextMode)
INJECTIONS: tuple[str, ...] = get_args(Injection)
COVERAGES: tuple[str, ...] = get_args(Coverage)
RECOMPUTE_POLICIES: tuple[str, ...] = get_args(RecomputePolicy)
POSITIONAL_POLICIES: tuple[str, ...] = get_args(PositionalPolicy)
#: Which tokens ``--recompute`` picks unless told: the context's tail, next to the question (docs/chunk-caches.md:
#: on real models it repaired more answers than CacheBlend's deviation choice, without its partial pass).
DEFAULT_RECOMPUTE_POLICY: RecomputePolicy = "end"
CHUNK_PREFIXES: tuple[str, ...] = get_args(ChunkPrefix)
STORED_CHUNK_PREFIXES: tuple[str, ...] = get_args(StoredChunkPrefix)
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)

#: Old spellings still accepted (and what they mean now): ``direct`` injection was renamed ``inject-all`` so that
#: ``direct`` names only the context mode that reads the text.
OLD_SPELLINGS: dict[str, str] = {"direct": "inject-all"}


def choose(what: str, value: str, choices: tuple[str, ...], error: type[Exception] = MotCagError) -> str:
    """``value`` as one of ``choices`` (an old spelling is translated), or one clear error naming ``what``.

    Example: ``choose("injection", "direct", INJECTIONS)`` returns ``"inject-all"``.
    """
    if value not in choices and OLD_SPELLINGS.get(value) in choices:
        value = OLD_SPELLINGS[value]
    if value not in choices:
        raise error(f"Unknown {what} {value!r}; choose one of {', '.join(choices)}.")
    return value
