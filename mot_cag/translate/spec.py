"""What a translator is: the spec a user asks for (:class:`TranslatorSpec`, built into a module by
:func:`~mot_cag.translate.mot.build_translator`) and the config saved with its weights
(:class:`TranslatorConfig`, enough to rebuild it and to refuse the wrong pair)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from mot_cag.models.layout import KVLayout
from mot_cag.names import COVERAGES, Coverage, choose
from mot_cag.translate.layers import LayerMap

TranslatorKind = Literal["mot", "single", "ridge"]
TRANSLATOR_KINDS = ("mot", "single", "ridge")
ExpertKind = Literal["attn", "mlp", "linear"]
EXPERT_KINDS = ("attn", "mlp", "linear")
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class ExpertShape:
    """The shape of a translator's experts, shared by what is asked for (:class:`TranslatorSpec`) and what was
    built (:class:`TranslatorConfig`); keyword-only, so each subclass keeps its own positional fields first.

    Attributes:
        coverage: Injection the translator is built for (``inject-all`` covers every target layer and can
            also replay; ``replay`` covers only the window). Files before this name say ``mode`` and ``direct``.
        expert: Expert kind (``attn``, ``mlp``, ``linear``).
        experts: Number of experts K per mixture.
        top_k: Experts mixed per token (at most K).
        hidden: Expert hidden width.
        heads: Attention heads of ``attn`` experts.
    """

    coverage: Coverage = "inject-all"
    expert: ExpertKind = "attn"
    experts: int = 4
    top_k: int = 2
    hidden: int = 128
    heads: int = 4

    def _check_names(self) -> None:
        self.coverage = choose("translator coverage", self.coverage, COVERAGES, ValueError)
        if self.expert not in EXPERT_KINDS:
            raise ValueError(f"expert must be one of {EXPERT_KINDS}, got '{self.expert}'.")


@dataclass
class TranslatorConfig(ExpertShape):
    """Everything needed to rebuild a translator and to refuse the wrong pair.

    Attributes:
        source: Source model name.
        target: Target model name.
        source_layout: Source :class:`KVLayout` as a dict.
        target_layout: Target :class:`KVLayout` as a dict.
        layer_map: :class:`LayerMap` as a dict.
        (coverage, expert, experts, top_k, hidden, heads: see :class:`ExpertShape`.)
        pos_features: Sinusoidal target-position features (0 for RoPE targets, which get rotated keys).
        prev_token: How many previous tokens' source K/V the experts' linear part also reads (zeros before a
            chunk's first token): target layers above previous-token heads depend on them. ``True`` means 1.
        token_features: Width of the target's input embeddings fed to the experts beside the source K/V (0:
            off). Direct injection knows the target's token ids; their embeddings (a table lookup, the target
            never runs) give the token identity the target's own layers key on; with ``prev_token`` the
            previous tokens' embeddings are added too.
        token_rank: When > 0, the normalised embeddings are projected onto their first ``token_rank``
            principal directions (fitted at calibration) before the experts read them.
        source_fingerprint: Weights+tokenizer fingerprint of the source (``registry.fingerprint``).
        target_fingerprint: Same for the target.
        source_tokenizer: Tokenizer fingerprint of the source (``alignment.tokenizer_fingerprint``).
        target_tokenizer: Same for the target.
        kind: ``mot`` (K > 1), ``single`` (K = 1, trained) or ``ridge`` (closed form).
        source_head: The source prompt head its source chunks were prefilled after (a prefixed store's
            ``prefix_ids``); empty: chunks prefilled alone.
        target_head: The target prompt head its output follows (empty: none).
        training: Summary of how it was made (steps, losses, data, seconds...).
        version: File format version.
    """

    source: str
    target: str
    source_layout: dict
    target_layout: dict
    layer_map: dict
    pos_features: int = 0
    prev_token: int = 0
    token_features: int = 0
    token_rank: int = 0
    source_fingerprint: str = ""
    target_fingerprint: str = ""
    source_tokenizer: str = ""
    target_tokenizer: str = ""
    kind: str = "mot"
    source_head: list[int] = field(default_factory=list)
    target_head: list[int] = field(default_factory=list)
    training: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        self._check_names()
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"Need experts >= 1 and 1 <= top_k <= experts; got experts={self.experts}, "
                             f"top_k={self.top_k}.")
        if self.expert == "attn" and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}).")

    @property
    def src(self) -> KVLayout:
        """Source layout."""
        return KVLayout.from_dict(self.source_layout)

    @property
    def tgt(self) -> KVLayout:
        """Target layout."""
        return KVLayout.from_dict(self.target_layout)

    @property
    def side_features(self) -> int:
        """Width of the per-token side features ``p``: positions, then target embeddings (and previous)."""
        return self.pos_features + self.token_width * (1 + int(self.prev_token))

    @property
    def token_width(self) -> int:
        """Width of the token features the experts read: the embedding width, or ``token_rank`` when the
        embeddings are projected onto their principal directions first."""
        return self.token_rank or self.token_features

    @property
    def layers(self) -> LayerMap:
        """The layer map."""
        return LayerMap.from_dict(self.layer_map)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TranslatorConfig:
        """Inverse of :meth:`to_dict`; keys from newer files are ignored, missing optional keys defaulted."""
        names = set(cls.__dataclass_fields__)
        if "coverage" not in d and "mode" in d:  # written before the rename
            d = {**d, "coverage": d["mode"]}
        return cls(**{k: v for k, v in d.items() if k in names})



@dataclass
class TranslatorSpec(ExpertShape):
    """The architecture of a translator to build, chosen once (``mot-cag train`` options) and passed whole.

    Attributes:
        kind: ``mot`` (K experts), ``single`` (K = 1, trained) or ``ridge`` (the closed-form linear map);
            ``None`` labels it by K (``mot`` when K > 1, else ``single``).
        (coverage, expert, experts, top_k, hidden, heads: see :class:`ExpertShape`; ``single`` and ``ridge``
        use K = 1.)
        window_start: First injected target layer in replay (default: top-aligned window).
        window_width: Replay window width (default: 30% of the shallower depth).
        pos_features: Position features (default 32 for absolute-position targets, 0 for RoPE).
        prev_token: Previous tokens whose features the experts also read (0: none).
        token_features: Feed the target's token embeddings to the experts (see :class:`TranslatorConfig`).
        token_rank: Project them onto this many principal directions first (0: the full width); keeps a
            translator small for targets with wide embeddings.
    """

    kind: TranslatorKind | None = None
    window_start: int | None = None
    window_width: int | None = None
    pos_features: int | None = None
    prev_token: int = 0
    token_features: bool = False
    token_rank: int = 0

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in TRANSLATOR_KINDS:
            raise ValueError(f"Unknown translator kind '{self.kind}'; use mot, single or ridge.")
        self._check_names()
        if self.kind in ("single", "ridge"):
            self.experts = 1
        if self.kind == "ridge":
            self.expert = "linear"
        if self.experts < 1 or self.top_k < 1:
            raise ValueError(f"Need experts >= 1 and top_k >= 1; got experts={self.experts}, top_k={self.top_k}.")
        self.top_k = min(self.top_k, self.experts)

    @property
    def label(self) -> str:
        """The kind a listing shows."""
        return self.kind or ("mot" if self.experts > 1 else "single")
