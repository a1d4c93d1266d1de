"""The zoo: four tiny models of real Hugging Face architectures, their specs and where they live.

=============  ===========  =========  ======  =====  ========  ======================
name           architecture tokenizer  layers  width  heads/kv  positions
=============  ===========  =========  ======  =====  ========  ======================
gpt2-mini      GPT-2        gpt2 (512)      4    192  6/6       learned absolute, 2048
opt-mini       OPT          opt (768)       3    256  8/8       learned absolute (+2), 2048
qwen2-mini     Qwen2        qwen2 (640)     4    192  6/2       RoPE (base 1e9), 2048
qwen2-small    Qwen2        qwen2 (640)     3    256  8/2       RoPE (base 1e9), 2048
=============  ===========  =========  ======  =====  ========  ======================

Every spec also records the copy-circuit layout used at initialisation (see :mod:`mot_cag.zoo.circuits`):
how many residual dimensions hold the token embedding, which previous-token offsets get a constructed
head, and (absolute-position models) how many dimensions hold sinusoidal positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import GPT2Config, OPTConfig, PretrainedConfig, Qwen2Config

ZOO_DIR = Path(__file__).resolve().parent / "models"
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class ZooSpec:
    """Architecture and recipe hyper-parameters of one zoo model."""

    name: str
    family: str  # "gpt2" | "opt" | "qwen2"; also names the tokenizer
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    embed_dims: int = 32  # residual dims holding the token code at init
    prev_offsets: tuple[int, ...] = (1, 2)  # constructed previous-token heads (layer 0)
    pos_dims: int = 0  # sinusoidal position dims (absolute-position models only)
    induction: bool = True  # constructed bigram induction head (layer 1)
    # Large RoPE base: the slowest pairs barely rotate over 2048 positions, so content matching works there.
    rope_theta: float = 1e9
    lr: float = 5e-4
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.width // self.heads

    def to_dict(self) -> dict:
        """JSON-serialisable form (for cards and run state)."""
        d = asdict(self)
        d["prev_offsets"] = list(self.prev_offsets)
        return d


ZOO: dict[str, ZooSpec] = {
    s.name: s
    for s in [
        ZooSpec("gpt2-mini", "gpt2", layers=4, width=192, heads=6, kv_heads=6, ffn=768, pos_dims=32),
        ZooSpec(
            "opt-mini", "opt", layers=3, width=256, heads=8, kv_heads=8, ffn=1024, pos_dims=32, prev_offsets=(1, 2)
        ),
        ZooSpec("qwen2-mini", "qwen2", layers=4, width=192, heads=6, kv_heads=2, ffn=512),
        ZooSpec("qwen2-small", "qwen2", layers=3, width=256, heads=8, kv_heads=2, ffn=768, prev_offsets=(1, 2)),
    ]
}


def get_spec(name: str) -> ZooSpec:
    """Return the spec of a zoo model.

    Raises:
        KeyError: With the list of zoo names when ``name`` is unknown.
    """
    if name not in ZOO:
        raise KeyError(f"Unknown zoo model '{name}'; the zoo has {', '.join(ZOO)}.")
    return ZOO[name]


def model_dir(name: str) -> Path:
    """Folder where a zoo model is shipped (``mot_cag/zoo/models/<name>``)."""
    return ZOO_DIR / name


def make_config(spec: ZooSpec, tokenizer) -> PretrainedConfig:
    """Build the Hugging Face config of a zoo model for a given tokenizer."""
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad = tokenizer.pad_token_id
    if spec.family == "gpt2":
        return GPT2Config(
            vocab_size=vocab,
            n_positions=MAX_POSITIONS,
            n_embd=spec.width,
            n_layer=spec.layers,
            n_head=spec.heads,
            n_inner=spec.ffn,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
    if spec.family == "opt":
        return OPTConfig(
            vocab_size=vocab,
            hidden_size=spec.width,
            num_hidden_layers=spec.layers,
            ffn_dim=spec.ffn,
            num_attention_heads=spec.heads,
            max_position_embeddings=MAX_POSITIONS,
            do_layer_norm_before=True,
            word_embed_proj_dim=spec.width,
            dropout=0.0,
            attention_dropout=0.0,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            tie_word_embeddings=False,
        )
    if spec.family == "qwen2":
        return Qwen2Config(
            vocab_size=vocab,
            hidden_size=spec.width,
            intermediate_size=spec.ffn,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            max_position_embeddings=MAX_POSITIONS,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    raise ValueError(f"Unknown family '{spec.family}'.")
