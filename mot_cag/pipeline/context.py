"""Context modes: how a target model gets the retrieved context before the question.

Every mode turns the same list of context pieces (chunk texts, with the source model's KV where it exists)
into one target-space :class:`~mot_cag.models.cache.KVChunk` covering, in order, the head of the target's
prompt (:class:`~mot_cag.prompts.PromptFormat`: BOS, and for real models the chat header and instruction)
and each piece's target tokens (with the format's separator). Token sequences are identical across modes, so
scores differ only by how the cache was obtained:

- ``direct``: the target prefills the concatenated text itself, one pass (cross-chunk attention included);
- ``native-chunks``: the target prefills each piece separately and the pieces are joined (RoPE: moved by
  rotation, cached per piece; absolute positions: prefilled at their global position);
- ``translated``: the source model's KV of each piece is translated into the target's cache space, and either
  used as it is (``direct`` injection), replayed piece by piece (``replay``), or replayed once over all pieces
  together (``replay-joint``: the target re-runs over the whole context with translated K/V in its window layers,
  so cross-chunk attention is restored in the layers it recomputes);
- ``none``: no context at all (only the head).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mot_cag.errors import MotCagError
from mot_cag.models import cache as kv
from mot_cag.models.positions import Positioner
from mot_cag.models.registry import LoadedModel
from mot_cag.names import (
    CONTEXT_MODES,
    DEFAULT_RECOMPUTE_POLICY,
    RECOMPUTE_POLICIES,
    ContextMode,
    RecomputePolicy,
    choose,
)
from mot_cag.prompts import PromptFormat, as_tensor, encode, prefixes_chunks, prompt_format

#: What ``--recompute auto`` (the default) recomputes of a real model's own stored chunks (pieces prefilled after
#: the prompt head), with the default policy ``end``: the context's last 35% of tokens, where the most relevant
#: chunk stands, re-read over all the others. Chosen on the dev corpus and the demo question (docs/chunk-caches.md);
#: deviation recompute at 0.1-0.15 had lowered the answers. Inject-all over another real model's prefixed chunks
#: gets the same repair over a longer tail (:data:`AUTO_RECOMPUTE_TRANSLATED`); zoo contexts and replay injections
#: get none by default.
AUTO_RECOMPUTE = 0.35

#: What ``--recompute auto`` recomputes (policy ``end``) when another real model's prefixed chunks are translated
#: into every layer of the target (the real pairs' auto injection): the context's last half. Translated chunks
#: carry a context's gist but not its exact facts, so more of the context is re-read natively than for a model's
#: own chunks. Chosen by a rule fixed before a held-out run (seed 61283, 6 pairs x 24 questions): as many right
#: answers as 0.35 (87 of 144 each) with a higher kl_benefit on every pair (mean 0.958 vs 0.936; at 0.35 one pair
#: fell to 0.876); docs/translators-real.md. Costs 0.09-0.2x of reading the text more time to first token
#: than 0.35 (Qwen target, 1k-4k tokens).
AUTO_RECOMPUTE_TRANSLATED = 0.5


@dataclass(frozen=True)
class Recompute:
    """Cross-chunk repair of joined caches: recompute a fraction of the tokens against the whole context.

    Attributes:
        ratio: Fraction of context tokens recomputed (0 = off, 1 = a full prefill); ``None`` (auto) lets the
            builder choose: :data:`AUTO_RECOMPUTE` for a model's own pieces prefilled after the prompt head,
            :data:`AUTO_RECOMPUTE_TRANSLATED` for another model's such pieces injected into every layer, else 0.
        policy: ``end`` (the default: the last tokens, next to the question), ``deviation`` (CacheBlend: tokens
            whose layer-1 K/V deviate most from a partial single pass), ``start`` (the first tokens of every piece
            after the first) or ``spread`` (evenly spaced).
    """

    ratio: float | None = None
    policy: RecomputePolicy = DEFAULT_RECOMPUTE_POLICY

    def __post_init__(self) -> None:
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise MotCagError(f"--recompute must be a fraction in [0, 1] (e.g. 0.1) or auto, got {self.ratio}.")
        choose("recompute policy", self.policy, RECOMPUTE_POLICIES)

    @classmethod
    def parse(cls, ratio: float | str | None, policy: str | None = None) -> Recompute:
        """From a CLI or pipeline value: ``auto`` (or ``None``) or a fraction.

        Raises:
            MotCagError: Neither ``auto`` nor a number in [0, 1].
        """
        if ratio is None or (isinstance(ratio, str) and ratio.strip().lower() == "auto"):
            return cls(None, policy or DEFAULT_RECOMPUTE_POLICY)
        try:
            value = float(ratio)
        except (TypeError, ValueError):
            raise MotCagError(f"--recompute must be auto or a fraction in [0, 1] (e.g. 0.1), got {ratio!r}.") from None
        return cls(value, policy or DEFAULT_RECOMPUTE_POLICY)

    def resolved(self, prefixed: bool, translated: bool = False) -> Recompute:
        """This repair with ``auto`` made concrete for a builder: prefixed pieces or not, a model's own pieces or
        another model's translated into every layer (:data:`AUTO_RECOMPUTE_TRANSLATED`)."""
        if self.ratio is not None:
            return self
        if not prefixed:
            return Recompute(0.0, self.policy)
        return Recompute(AUTO_RECOMPUTE_TRANSLATED if translated else AUTO_RECOMPUTE, self.policy)

    def apply(self, model, ctx: TargetContext) -> TargetContext:
        """``ctx`` with the chosen tokens' K/V recomputed (unchanged when the ratio is 0)."""
        if not self.ratio or ctx.kv is None or not ctx.ids:
            return ctx
        from mot_cag.models.recompute import deviation_indices, recompute_indices

        t0 = time.perf_counter()
        ids = as_tensor(ctx.ids, ctx.kv.keys.device)
        if self.policy == "deviation":
            idx = deviation_indices(model, ctx.kv, ids, self.ratio)
        else:
            idx = recompute_indices(self.policy, ctx.kv.length, self.ratio, ctx.piece_starts or [0])
        with torch.no_grad():
            chunk = kv.selective_recompute(model, ctx.kv, ids, idx)
        timings = dict(ctx.timings)
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        return TargetContext(chunk, ctx.tokens, timings, ctx.ids, ctx.piece_starts)


@dataclass
class Piece:
    """One context piece (a retrieved chunk, or a whole document).

    Attributes:
        text: The piece's text as stored.
        key: Stable identity (content hash) used for caching; defaults to the text.
        source_kv: Loads the source model's KV of this piece (prefilled at 0), if any.
        doc: The document it was retrieved from (store pieces), if any.
    """

    text: str
    key: str | None = None
    source_kv: Callable[[], kv.KVChunk] | None = None
    doc: str | None = None

    @property
    def cache_key(self) -> str:
        return self.key or self.text


@dataclass
class TargetContext:
    """A target-space context ready for the question."""

    kv: kv.KVChunk | None
    tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # the context's target token ids (BOS included)
    piece_starts: list[int] = field(default_factory=list)  # where each separately made part begins (BOS + first: 0)


#: Default bound of a builder's cache of made pieces: with real models one chunk's KV is megabytes, so the bound
#: is in bytes, not entries. ``MOT_CAG_CACHE_MB`` changes it.
DEFAULT_CACHE_BYTES = 1 << 30


def nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, a KV chunk or other object holding tensors, or a tuple)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(nbytes(v) for v in vars(value).values())
    return 0


class LRU(OrderedDict):
    """A least-recently-used map of made pieces (translated or native chunks of one target), bounded by the
    bytes of the tensors it holds: the least recently used go first once the total passes ``max_bytes``
    (default :data:`DEFAULT_CACHE_BYTES`, or ``$MOT_CAG_CACHE_MB``). One value larger than the bound is not kept.
    """

    def __init__(self, max_bytes: int | None = None):
        super().__init__()
        if max_bytes is None:
            env = os.environ.get("MOT_CAG_CACHE_MB")
            max_bytes = int(float(env) * (1 << 20)) if env else DEFAULT_CACHE_BYTES
        self.max_bytes = max_bytes
        self.bytes = 0
        self._sizes: dict = {}
        self.hits = 0
        self.misses = 0

    def get_or(self, key, make: Callable[[], object]):
        if key in self:
            self.move_to_end(key)
            self.hits += 1
            return self[key]
        self.misses += 1
        value = make()
        size = nbytes(value)
        if size > self.max_bytes:
            return value
        self[key] = value
        self._sizes[key] = size
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, _ = self.popitem(last=False)
            self.bytes -= self._sizes.pop(old)
        return value


class ContextBuilder:
    """Builds a target's context in one mode.

    Args:
        target: The answering model.
        prompt: Its prompt format (default: :func:`~mot_cag.prompts.prompt_format` of ``target``); the head's
            ids start every context and its separator ends every piece.
    """

    mode: str = "?"

    def __init__(self, target: LoadedModel, prompt: PromptFormat | None = None):
        self.target = target
        self.device = target.device
        self.prompt = prompt or prompt_format(target)
        self.head = list(self.prompt.head)
        self.positioner = Positioner(target.layout, target.model.config)
        self._head_kv: kv.KVChunk | None = None

    def build(self, pieces: list[Piece]) -> TargetContext:  # pragma: no cover - abstract
        raise NotImplementedError

    def _head_chunk(self) -> kv.KVChunk | None:
        """KV of the prompt head, computed once per builder (it is the same for every question)."""
        if not self.head:
            return None
        if self._head_kv is None:
            self._head_kv = kv.prefill(self.target.model, as_tensor(self.head, self.device))
        return self._head_kv

    def piece_ids(self, piece: Piece) -> list[int]:
        """The piece's target ids: its text and the format's separator, tokenized together as a single pass
        would (``.\n\n`` is one token for most BPEs; splitting it changed a real model's answer)."""
        return encode(self.target.tokenizer, self.prompt.piece_text(piece.text))


class NoneContext(ContextBuilder):
    """No context: the target sees only its prompt head (if any) before the question."""

    mode = "none"

    def build(self, pieces: list[Piece]) -> TargetContext:
        t0 = time.perf_counter()
        chunk = self._head_chunk()
        return TargetContext(chunk, len(self.head), {"prefill_s": time.perf_counter() - t0}, list(self.head))


class DirectContext(ContextBuilder):
    """The target reads the pieces' text itself (one prefill over everything)."""

    mode = "direct"

    def build(self, pieces: list[Piece]) -> TargetContext:
        t0 = time.perf_counter()
        ids = list(self.head)
        for p in pieces:
            ids += self.piece_ids(p)
        chunk = kv.prefill(self.target.model, as_tensor(ids, self.device)) if ids else None
        return TargetContext(chunk, len(ids), {"prefill_s": time.perf_counter() - t0}, ids)


class _JoinedChunks(ContextBuilder):
    """Shared assembly of per-piece caches: the prompt head first, then each piece (its text and the format's
    separator) placed after the previous one.

    RoPE targets make each piece once (cached by piece) and move it by rotation; absolute-position targets make
    it where it will sit (cached by piece and position), since positions live in every layer. With
    :attr:`prefixed`, pieces are made after the prompt head (attending to it, the head's KV
    kept once at the front): each piece then sees the context it is read in, and the head's first token is
    the attention sink instead of each piece's (Block-Attention, TurboRAG). Without it each is made alone.
    Subclasses say how one piece's cache is made (:meth:`make`) and which timing it counts as.

    Args:
        target: The answering model.
        cache: LRU of made pieces (shared across builders of one target, optional).
        recompute: Cross-chunk repair of the joined context (default auto: see :data:`AUTO_RECOMPUTE`).
        prompt: The target's prompt format (default: its own).
        prefixed: Make pieces after the prompt head (default: for RoPE targets whose format has a head other
            than the zoo's BOS, i.e. chat and completion prompts of real models).
    """

    timing = "prefill_s"
    #: Whether a piece's ids include the format's separator (translators cover a chunk's own text only).
    separated = True

    def __init__(self, target: LoadedModel, cache: LRU | None = None, recompute: Recompute | None = None,
                 prompt: PromptFormat | None = None, prefixed: bool | None = None):
        super().__init__(target, prompt)
        self.cache = cache if cache is not None else LRU()
        rope = target.layout.positions == "rope"
        if prefixed is None:
            prefixed = prefixes_chunks(self.prompt, target.layout.positions)
        if prefixed and not rope:
            raise MotCagError(f"{target.name} has absolute positions: its pieces cannot be prefilled after the "
                              "prompt head and moved; use prefixed=False.")
        self.prefixed = prefixed
        self.recompute = (recompute or Recompute()).resolved(prefixed)

    def part_key(self, piece: Piece) -> str:
        """The LRU key of a piece's part (subclasses add what else its KV depends on)."""
        return piece.cache_key

    def make(self, piece: Piece, ids: list[int], start: int) -> kv.KVChunk:  # pragma: no cover - abstract
        raise NotImplementedError

    def build(self, pieces: list[Piece]) -> TargetContext:
        """The joined context, repaired by :attr:`recompute` when its ratio is above 0."""
        return self.recompute.apply(self.target.model, self.join(pieces))

    def piece_ids(self, piece: Piece) -> list[int]:
        """Text and separator tokenized together when :attr:`separated`, else the text alone."""
        if self.separated:
            return super().piece_ids(piece)
        return encode(self.target.tokenizer, piece.text)

    def own_prefill(self, ids: list[int], start: int) -> kv.KVChunk:
        """The target's own KV of ``ids``: after the prompt head when :attr:`prefixed` (placed at
        ``len(head)``), else alone at ``start``."""
        if self.prefixed:
            return kv.prefill_after(self.target.model, as_tensor(ids, self.device), self._head_chunk())
        return kv.prefill(self.target.model, as_tensor(ids, self.device), start=start)

    def _place(self, key: str, make: Callable[[int], kv.KVChunk], pos: int) -> kv.KVChunk:
        """A cached part moved to ``pos`` (RoPE), or made at ``pos`` (absolute positions)."""
        if self.target.layout.positions == "rope":
            return self.positioner.reposition(self.cache.get_or(key, lambda: make(0)), pos)
        return self.cache.get_or((key, pos), lambda: make(pos))

    def join(self, pieces: list[Piece]) -> TargetContext:
        """Each piece's cache made (or taken from the LRU) and placed after the previous one."""
        t0 = time.perf_counter()
        parts = [self.head_part(c) for c in [self._head_chunk()] if c is not None]
        pos = len(self.head)
        all_ids = list(self.head)
        starts: list[int] = [0]
        for p in pieces:
            ids = self.piece_ids(p)
            if not ids:
                continue
            if len(all_ids) > len(self.head):
                starts.append(pos)
            part = self._place(self.part_key(p), lambda at, p=p, ids=ids: self.make(p, ids, at), pos)
            if part.length != len(ids):
                raise MotCagError(f"A context piece's cache holds {part.length} tokens but its text encodes to "
                                  f"{len(ids)} {self.target.name} tokens; the store was made with another "
                                  "tokenizer: re-ingest it.")
            parts.append(part)
            all_ids += ids
            pos += len(ids)
        chunk = kv.join(parts) if parts else None
        return TargetContext(chunk, pos, {self.timing: time.perf_counter() - t0}, all_ids, starts)

    def head_part(self, chunk: kv.KVChunk) -> kv.KVChunk:
        """A target-made chunk as it enters the join (all layers; subclasses joining fewer layers select them)."""
        return chunk


class NativeChunksContext(_JoinedChunks):
    """The target's own caches of each piece, prefilled separately and joined."""

    mode = "native-chunks"

    def make(self, piece: Piece, ids: list[int], start: int) -> kv.KVChunk:
        return self.own_prefill(ids, start)

    def part_key(self, piece: Piece) -> str:
        return f"{piece.cache_key}\0prefixed" if self.prefixed else piece.cache_key


TranslateFn = Callable[[Piece, int], kv.KVChunk]
"""Translate one piece into the target's cache space at a global start position."""


class TranslatedContext(_JoinedChunks):
    """Source caches of each piece translated into the target's cache space and joined.

    Args:
        target: The answering model.
        translate_piece: ``(piece, start) -> KVChunk`` in the target's layout, covering
            ``encode(target.tokenizer, piece.text)`` at positions ``start..``.
        cache: LRU of translated pieces (keyed by piece and, for absolute-position targets, start).
    """

    mode = "translated"
    timing = "translate_s"

    def __init__(self, target: LoadedModel, translate_piece: TranslateFn, cache: LRU | None = None,
                 recompute: Recompute | None = None, prompt: PromptFormat | None = None,
                 prefixed: bool | None = None, separated: bool = False):
        super().__init__(target, cache, recompute, prompt, prefixed)
        self.translate_piece = translate_piece
        # Stored chunks of a prefixed store hold text + separator; translators cover a chunk's own text only.
        self.separated = separated

    def make(self, piece: Piece, ids: list[int], start: int) -> kv.KVChunk:
        return self.translate_piece(piece, start)


class ReplayJointContext(TranslatedContext):
    """Translated pieces replayed together: the paper's replay injection over the whole retrieved context.

    Each piece's translated K/V of the replay window's layers is made as in :class:`TranslatedContext`
    (cached per piece), the pieces are joined after the target's own BOS K/V, and the target runs once over
    all context tokens with those K/V substituted in the window layers. Layers below the window compute the
    target's own K/V with attention across pieces; layers above re-read the translated window. The pass costs
    about one target prefill of the context, reported as ``prefill_s``.

    Args:
        target: The answering model.
        translate_piece: ``(piece, start) -> KVChunk`` of the translator's target layers (see
            :func:`~mot_cag.translate.inject.injected_kv`), at positions ``start..``.
        layers: Target layer of each row of ``translate_piece``'s chunks.
        window: Target layers whose K/V are substituted in the replay.
        cache: LRU of translated pieces.
    """

    def __init__(self, target: LoadedModel, translate_piece: TranslateFn, layers: list[int], window: list[int],
                 cache: LRU | None = None, recompute: Recompute | None = None, prefixed: bool | None = None):
        super().__init__(target, translate_piece, cache, recompute, prefixed=prefixed)
        if not set(window) <= set(layers):
            raise ValueError(f"replay window {window} is not among the translated layers {layers}")
        self.layers = list(layers)
        self.window = list(window)
        if self.positioner.layer_groups is not None:
            # Parts hold only self.layers' rows: index each RoPE base's layers by their row here (Gemma3).
            rows = {layer: i for i, layer in enumerate(self.layers)}
            groups = [([rows[x] for x in idx if x in rows], inv) for idx, inv in self.positioner.layer_groups]
            self.positioner.layer_groups = [(idx, inv) for idx, inv in groups if idx]

    def head_part(self, chunk: kv.KVChunk) -> kv.KVChunk:
        idx = torch.tensor(self.layers, device=chunk.keys.device)
        return kv.KVChunk(chunk.keys[idx], chunk.values[idx], chunk.start)  # (n, H, T, D)

    def join(self, pieces: list[Piece]) -> TargetContext:
        joined = super().join(pieces)
        if joined.kv is None or not joined.ids:
            return joined
        t0 = time.perf_counter()
        rows = {t: i for i, t in enumerate(self.layers)}
        substitute = {t: (joined.kv.keys[rows[t]], joined.kv.values[rows[t]]) for t in self.window}  # (H, T, D)
        with torch.no_grad():
            _, chunk = kv.replay_forward(self.target.model, as_tensor(joined.ids, self.device), substitute, start=0,
                                         need_logits=False)
        joined.timings["prefill_s"] = time.perf_counter() - t0
        return TargetContext(chunk, joined.tokens, joined.timings, joined.ids, joined.piece_starts)


def make_builder(mode: ContextMode, target: LoadedModel, translate_piece: TranslateFn | None = None,
                 recompute: Recompute | None = None) -> ContextBuilder:
    """The builder of a mode name (``translated`` needs ``translate_piece``; ``recompute`` applies to the modes
    that join separately made caches, native-chunks and translated)."""
    if mode == "none":
        return NoneContext(target)
    if mode == "direct":
        return DirectContext(target)
    if mode == "native-chunks":
        return NativeChunksContext(target, recompute=recompute)
    if mode == "translated":
        if translate_piece is None:
            raise ValueError("translated mode needs a translate_piece function")
        return TranslatedContext(target, translate_piece, recompute=recompute)
    raise MotCagError(f"Unknown context mode {mode!r}; choose one of {', '.join(CONTEXT_MODES)}.")
