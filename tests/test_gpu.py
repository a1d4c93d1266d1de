"""The CUDA path: caches, translation and assembled contexts on a GPU equal the CPU's (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from mot_cag.models import cache as kv
from mot_cag.pipeline.context import DirectContext, NativeChunksContext, Piece
from mot_cag.prompts import as_tensor, encode

pytestmark = pytest.mark.gpu

TEXT = "Ana Brell was born in Corvale. Ana Brell works as a baker. Tomas Reddick lives in Pastowe."


@pytest.fixture(scope="module")
def gpu_models(tiny_dir):
    from mot_cag.models.registry import load_model

    return {fam: load_model(str(tiny_dir / f"tiny-{fam}"), device="cuda") for fam in ("gpt2", "opt", "qwen2")}


@pytest.mark.parametrize("fam", ["gpt2", "opt", "qwen2"])
def test_prefill_on_cuda_equals_cpu(tiny_models, gpu_models, fam):
    cpu, gpu = tiny_models[fam], gpu_models[fam]
    ids = encode(cpu.tokenizer, TEXT)
    a = kv.prefill(cpu.model, as_tensor(ids, cpu.device))
    b = kv.prefill(gpu.model, as_tensor(ids, gpu.device))
    assert b.keys.is_cuda
    torch.testing.assert_close(b.keys.cpu(), a.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.values.cpu(), a.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("src,tgt", [("gpt2", "qwen2"), ("qwen2", "opt")])
def test_translation_on_cuda_equals_cpu(tiny_models, gpu_models, src, tgt):
    from mot_cag.translate.alignment import token_alignment
    from mot_cag.translate.inject import translate
    from mot_cag.translate.mot import build_translator

    s, t = tiny_models[src], tiny_models[tgt]
    torch.manual_seed(0)
    tr = build_translator(s, t, experts=2, top_k=1, hidden=32).eval()
    al = token_alignment(s.tokenizer, t.tokenizer, TEXT)
    chunk = kv.prefill(s.model, al.src_ids)
    with torch.no_grad():
        want = translate(tr, chunk, al.W, t, al.tgt_ids, injection="inject-all")
        got = translate(tr.to("cuda"), chunk.to(device="cuda"), al.W.cuda(), gpu_models[tgt], al.tgt_ids.cuda(),
                        injection="inject-all")
    assert got.keys.is_cuda
    torch.testing.assert_close(got.keys.cpu(), want.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.values.cpu(), want.values, atol=1e-4, rtol=1e-4)


def test_joined_context_and_greedy_answer_on_cuda(tiny_models, gpu_models):
    pieces = [Piece(TEXT[:40]), Piece(TEXT[40:])]
    for m in (tiny_models["qwen2"], gpu_models["qwen2"]):
        ctx = NativeChunksContext(m).build(pieces)
        assert ctx.kv.keys.device.type == m.device.type
    cpu_ctx = DirectContext(tiny_models["qwen2"]).build(pieces)
    gpu_ctx = DirectContext(gpu_models["qwen2"]).build(pieces)
    torch.testing.assert_close(gpu_ctx.kv.keys.cpu(), cpu_ctx.kv.keys, atol=1e-4, rtol=1e-4)
    q = encode(tiny_models["qwen2"].tokenizer, " Question:")
    a = list(kv.greedy_tokens(tiny_models["qwen2"].model, as_tensor(q, "cpu"), cpu_ctx.kv, 8))
    b = list(kv.greedy_tokens(gpu_models["qwen2"].model, as_tensor(q, "cuda"), gpu_ctx.kv, 8))
    assert len(a) == 8 and a == b
