"""Tiny random models of each supported family, built offline, for fast tests.

Each builder saves a real Hugging Face model folder (safetensors, config, fast tokenizer) so tests exercise the
same loading path as real checkpoints. Tokenizers are small byte-level BPEs trained on a few sentences.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CORPUS = [
    "Ana Brell was born in Corvale. The favorite color of Ana Brell is green.",
    "Tomas Reddick works as a baker. The access code of Tomas Reddick is 48213.",
    "Question: Where was Ana Brell born?\nAnswer: Ana Brell was born in Corvale.",
    "Mira Hollen lives in Pastowe. Mira Hollen plays the violin. Repeat: the quick brown fox.",
] * 20


def make_tokenizer(vocab_size: int, bos: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE fast tokenizer; ``bos`` is prepended to every encoding when given (OPT style)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] + ([bos] if bos and bos != "<|endoftext|>" else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token=bos or "<|endoftext|>", pad_token="<|endoftext|>")


def _save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build(family: str, path: Path, seed: int = 0) -> Path:
    """Save a tiny random model of ``family`` (gpt2, opt, qwen2, gemma3) to ``path``.

    The Gemma3 one has Gemma3's layer pattern in small: 6 layers, the first 5 sliding-window (window 8,
    RoPE base 1e4) and the last full attention (base 1e6), one KV head, QK-norm.
    """
    torch.manual_seed(seed)
    if family == "gpt2":
        tok = make_tokenizer(300)
        cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    elif family == "opt":
        tok = make_tokenizer(320, bos="</s>")
        cfg = OPTConfig(vocab_size=len(tok), max_position_embeddings=256, hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    elif family == "qwen2":
        tok = make_tokenizer(340)
        cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=2048, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    elif family == "gemma3":
        tok = make_tokenizer(360, bos="<bos>")
        cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                               max_position_embeddings=2048, query_pre_attn_scalar=16,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    else:
        raise ValueError(family)
    model = AutoModelForCausalLM.from_config(cfg)
    return _save(model, tok, path)
