"""KV-cache translation by a Mixture-of-Translators (MoT, arXiv 2607.28979).

Public API (everything callable from Python; the CLI's ``train`` and ``translators`` are thin wrappers)::

    from mot_cag.translate import (token_alignment, build_translator, translate, find_translator,
                                   load_translator, save_translator, list_translators)

    al = token_alignment(source.tokenizer, target.tokenizer, text)          # (src_ids, tgt_ids, W [T_t, T_s])
    chunk = prefill(source.model, al.src_ids)                                # or a stored source chunk
    tr = load_translator(find_translator(source.name, target.name), source, target)
    ctx = translate(tr, chunk, al.W, target, al.tgt_ids, target_start=0, injection="inject-all")  # a KVChunk
    logits, _ = forward(target.model, question_ids, ctx)

Modules: :mod:`.alignment` (cross-tokenizer averaging matrix), :mod:`.layers` (layer map and injection
window), :mod:`.mot` (config, experts, router, :class:`Translator`), :mod:`.inject` (positions, direct and
replay injection), :mod:`.ridge` (calibration and the closed-form baseline), :mod:`.train` (losses, training
loop, held-out fidelity), :mod:`.data` (training pairs), :mod:`.checkpoint` (files, search, refusal),
:mod:`.sweep` (results table and injection sweep).
"""

from mot_cag.translate.alignment import Alignment, token_alignment, tokenizer_fingerprint
from mot_cag.translate.checkpoint import (
    check_pair,
    find_translator,
    list_translators,
    load_translator,
    save_translator,
)
from mot_cag.translate.inject import translate
from mot_cag.translate.layers import LayerMap
from mot_cag.translate.mot import Translator, build_translator
from mot_cag.translate.spec import TranslatorConfig, TranslatorSpec

__all__ = [
    "Alignment",
    "LayerMap",
    "Translator",
    "TranslatorConfig",
    "TranslatorSpec",
    "build_translator",
    "check_pair",
    "find_translator",
    "list_translators",
    "load_translator",
    "save_translator",
    "token_alignment",
    "tokenizer_fingerprint",
    "translate",
]
