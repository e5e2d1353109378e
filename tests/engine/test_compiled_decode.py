"""Compiled CPU kernels (engine/layers/compiled_decode.py, engine/layers/compiled_rope.py): the
same numbers as the eager paths (gather + SDPA; Q/K norm and RoPE op by op), a safe fallback when
compiling fails, and wiring through ``enforce_eager``."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tokenrelay.engine.layers import attention, compiled_decode, compiled_rope
from tokenrelay.engine.layers.compiled import LazyCompiled
from tokenrelay.engine.llm import LLM
from tokenrelay.engine.loader import load_model
from tokenrelay.engine.sampling_params import SamplingParams

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="inductor needs a C++ compiler")


def _paged_batch(lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int):
    """Random caches with each sequence's blocks scattered over the pool (not in order)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start:start + n]
        start += n
    query = torch.randn(len(lens), hq, d, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_compiler
@pytest.mark.parametrize("lens,hq,hkv,d,block_size", [
    ([37, 5, 16, 1, 130, 64, 17, 99], 8, 4, 64, 16),    # GQA 2, ragged, exact multiples, 1 token
    ([3], 4, 4, 32, 16),                                # one sequence of one block (padded to 2)
    ([40] * 20 + [7] * 15, 6, 2, 16, 8),                # 35 sequences: three groups, GQA 3
    ([200, 1, 33], 4, 1, 64, 32),                       # MQA, larger blocks
])
def test_compiled_decode_matches_the_eager_path(lens, hq, hkv, d, block_size) -> None:
    q, k_cache, v_cache, tables, seq_lens = _paged_batch(lens, hq, hkv, d, block_size, len(lens))
    scale = d ** -0.5
    before = compiled_decode._KERNEL.calls
    with torch.inference_mode():
        eager = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
        compiled = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                                    scale, compiled=True)
    assert compiled_decode._KERNEL.failed is None
    assert compiled_decode._KERNEL.calls > before       # the kernel ran, not the fallback
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_decode_rows_of_a_mixed_step_take_the_compiled_kernel_too() -> None:
    """A step that batches prefill chunks with decodes: the decode rows go through the compiled
    kernel, the prefill rows through SDPA, and together they equal the eager step."""
    lens = [12, 30, 9, 50]
    q_lens = [1, 6, 1, 20]                               # rows 1 and 3 are prefill chunks
    _, k_cache, v_cache, tables, seq_lens = _paged_batch(lens, 8, 4, 32, 16, 7)
    query = torch.randn(sum(q_lens), 8, 32, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 1, 7, 8, 28], dtype=torch.int32)
    before = compiled_decode._KERNEL.calls
    with torch.inference_mode():
        eager = attention.paged_prefill_attention(query, k_cache, v_cache, tables, seq_lens, cu,
                                                  32 ** -0.5)
        compiled = attention.paged_prefill_attention(query, k_cache, v_cache, tables, seq_lens,
                                                     cu, 32 ** -0.5, compiled=True)
    assert compiled_decode._KERNEL.calls > before
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_a_failed_compile_falls_back_to_the_eager_path_for_good(monkeypatch, caplog) -> None:
    state = LazyCompiled(compiled_decode.decode_math, "CPU decode attention")

    def broken():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(state, "_get", broken)
    monkeypatch.setattr(compiled_decode, "_KERNEL", state)
    q, k_cache, v_cache, tables, seq_lens = _paged_batch([20, 3, 41], 8, 4, 32, 16, 3)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, "tokenrelay.engine.layers.compiled"):
        eager = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2)
        got = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2,
                                               compiled=True)
        again = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2,
                                                 compiled=True)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(again, eager)
    assert state.failed is not None and "no C++ compiler" in state.failed
    assert state.calls == 0
    assert sum("using the eager path" in r.getMessage() for r in caplog.records) == 1


def test_enforce_eager_and_dtype_choose_the_decode_path(tiny_llama) -> None:
    compiled = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    eager = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, enforce_eager=True)
    half = LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=32)
    assert compiled.engine.model_runner.model.ops.name == "torch-compiled"
    assert eager.engine.model_runner.model.ops.name == "torch"
    assert half.engine.model_runner.model.ops.name == "torch"
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], [40 + i for i in range(20)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    a = compiled.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob,
                                                                abs=1e-4)


@needs_compiler
@pytest.mark.parametrize("arch", ["qwen3", "llama"])        # with and without Q/K RMSNorm
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_compiled_qk_norm_and_rope_match_the_eager_ops(tiny_checkpoint, arch, tokens) -> None:
    model = load_model(tiny_checkpoint(arch), dtype="float32")
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, sum(attn.split), generator=gen)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos_sin = model.cos_sin_cache
    before = compiled_rope._KERNEL.calls
    with torch.inference_mode():
        want = attn._qkv_eager(qkv.clone(), positions, cos_sin)
        got = compiled_rope.run(qkv, positions, cos_sin,
                                *((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                                  if attn.q_norm is not None else (None, None, 0.0)),
                                attn.num_heads, attn.num_kv_heads)
    assert got is not None and compiled_rope._KERNEL.calls == before + 1
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
