"""Three distinct small-vocabulary tokenizers for the zoo, trained on synthetic training text.

Small vocabularies (hundreds of tokens) are deliberate: invented names and digit strings become
sequences of frequent short pieces, so a copy circuit learned on some names applies to unseen ones.
Distinct vocabularies, sizes and pre-tokenizers are what make cross-tokenizer KV alignment real.

* ``gpt2``: byte-level BPE with GPT-2's pre-tokenizer, ``<|endoftext|>`` as BOS/EOS/PAD, no BOS added.
* ``opt``: byte-level BPE of another size with OPT's specials (``<s>``=0, ``<pad>``=1, ``</s>``=2,
  ``<unk>``=3) and, like OPT, ``</s>`` prepended to every encoded text.
* ``qwen2``: byte-level BPE behind Qwen2's regex, which splits digits one by one; ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``; no BOS added.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mot_cag.data.synthetic import qa_training_text, repeat_training_text

# Qwen2's pre-tokenizer pattern (digits are split individually by \p{N}).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerSpec:
    """How one zoo tokenizer is built."""

    family: str
    vocab_size: int
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    unk: str | None = None
    prepend_bos: bool = False


TOKENIZER_SPECS: dict[str, TokenizerSpec] = {
    "gpt2": TokenizerSpec("gpt2", 512, ("<|endoftext|>",), "<|endoftext|>", "<|endoftext|>", "<|endoftext|>"),
    "opt": TokenizerSpec(
        "opt", 768, ("<s>", "<pad>", "</s>", "<unk>"), "</s>", "</s>", "<pad>", "<unk>", prepend_bos=True
    ),
    "qwen2": TokenizerSpec(
        "qwen2", 640, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|endoftext|>", "<|endoftext|>"
    ),
}


def training_corpus(n_docs: int = 4000, seed: int = 1234) -> list[str]:
    """Synthetic training text (train split only) to fit the BPE merges on."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_docs):
        if rng.random() < 0.5:
            out.append(qa_training_text(rng, rng.randint(2, 5), rng.randint(1, 3), 3))
        else:
            out.append(repeat_training_text(rng, rng.randint(2, 4), 2))
    return out


def build_tokenizer(family: str, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a zoo tokenizer.

    Args:
        family: ``"gpt2"``, ``"opt"`` or ``"qwen2"``.
        corpus: Training texts; defaults to :func:`training_corpus` (deterministic).

    Returns:
        A fast tokenizer ready for ``save_pretrained``.
    """
    spec = TOKENIZER_SPECS[family]
    tok = Tokenizer(models.BPE(unk_token=None))
    if family == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or training_corpus(), trainer=trainer)
    if spec.prepend_bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)]
                ),
            ]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad, unk_token=spec.unk
    )
    fast.model_max_length = 2048
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> Path:
    """Save a tokenizer so ``AutoTokenizer.from_pretrained(folder)`` loads it offline."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return folder
