"""The references themselves, each against an independent formulation (no Triton involved).

Kernels are only as right as the references they are compared with, so every `_ref` is checked
against a differently-built computation: SDPA on contiguous K/V with an explicit mask, complex
multiplication for rotary, torch's own rms_norm, sigmoid for silu, index_put for store_kv.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels._testing import random_block_tables



@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(7)


def _paged_from_contiguous(ks, vs, page, num_blocks):
    """Scatter per-sequence contiguous K/V [S, Hkv, D] into random pages; return caches + table."""
    heads, dim = ks[0].shape[1:]
    k_cache = torch.randn(num_blocks, page, heads, dim, dtype=torch.float32)
    v_cache = torch.randn_like(k_cache)
    table = random_block_tables([k.shape[0] for k in ks], page, num_blocks)
    for b, (k, v) in enumerate(zip(ks, vs)):
        for pos in range(k.shape[0]):
            blk = int(table[b, pos // page])
            k_cache[blk, pos % page] = k[pos]
            v_cache[blk, pos % page] = v[pos]
    return k_cache, v_cache, table


def _sdpa(q, k, v, scale, context_len):
    """q [Q, Hq, D], k/v [S, Hkv, D] -> [Q, Hq, D] via SDPA with a boolean causal-offset mask."""
    group = q.shape[1] // k.shape[1]
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + context_len
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_ref_is_sdpa(heads, kv_heads):
    lens, page, dim = [1, 16, 17, 40], 16, 8
    ks = [torch.randn(s, kv_heads, dim, dtype=torch.float32) for s in lens]
    vs = [torch.randn(s, kv_heads, dim, dtype=torch.float32) for s in lens]
    k_cache, v_cache, table = _paged_from_contiguous(ks, vs, page, 12)
    q = torch.randn(len(lens), heads, dim, dtype=torch.float32)
    out = kernels.paged_decode_attention_ref(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), 0.3)
    for b, s in enumerate(lens):
        torch.testing.assert_close(out[b], _sdpa(q[b : b + 1], ks[b], vs[b], 0.3, s - 1)[0])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_prefill_ref_is_sdpa(heads, kv_heads):
    ctx, new, page, dim = [0, 7, 16, 3], [5, 1, 17, 0], 8, 8
    lens = [c + n for c, n in zip(ctx, new)]
    ks = [torch.randn(s, kv_heads, dim, dtype=torch.float32) for s in lens]
    vs = [torch.randn(s, kv_heads, dim, dtype=torch.float32) for s in lens]
    k_cache, v_cache, table = _paged_from_contiguous(ks, vs, page, 12)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, dim, dtype=torch.float32)
    out = kernels.paged_prefill_attention_ref(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32),
                                              cu, 0.5)
    for b, c in enumerate(ctx):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi > lo:
            torch.testing.assert_close(out[lo:hi], _sdpa(q[lo:hi], ks[b], vs[b], 0.5, c))


def test_store_kv_ref_is_index_put():
    k_cache = torch.randn(5, 4, 2, 8)
    v_cache = torch.randn_like(k_cache)
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([3, -1, 19, 0, -1, 7])
    k_exp, v_exp = k_cache.clone().view(20, 2, 8), v_cache.clone().view(20, 2, 8)
    keep = slots >= 0
    k_exp[slots[keep]] = key[keep]
    v_exp[slots[keep]] = value[keep]
    kernels.store_kv_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(20, 2, 8), k_exp) and torch.equal(v_cache.view(20, 2, 8), v_exp)


def test_rms_norm_refs_match_torch():
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    expected = F.rms_norm(x, (32,), w, eps=1e-6)
    torch.testing.assert_close(kernels.rms_norm_ref(x, w, 1e-6), expected)
    res_ref = res.clone()
    out = kernels.fused_add_rms_norm_ref(x, res_ref, w, 1e-6)
    torch.testing.assert_close(res_ref, res + x)
    torch.testing.assert_close(out, F.rms_norm(res + x, (32,), w, eps=1e-6))


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_ref_is_complex_rotation(is_neox):
    tokens, heads, dim, base = 5, 3, 16, 10000.0
    half = dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.tensor([0, 3, 31, 7, 7])
    q, k = torch.randn(tokens, heads, dim, dtype=torch.float32), torch.randn(tokens, 1, dim, dtype=torch.float32)

    def rotate(x):
        if is_neox:
            z = torch.complex(x[..., :half], x[..., half:])
        else:
            z = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2).contiguous())
        z = z * torch.polar(torch.ones_like(angles), angles)[positions][:, None, :]
        if is_neox:
            return torch.cat([z.real, z.imag], dim=-1)
        return torch.view_as_real(z).flatten(-2)

    q_exp, k_exp = rotate(q), rotate(k)
    kernels.rotary_ref(q, k, positions, cache, is_neox)
    torch.testing.assert_close(q, q_exp)
    torch.testing.assert_close(k, k_exp)


def test_silu_and_mul_ref_is_sigmoid_form():
    x = torch.randn(4, 10) * 5
    expected = x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:]
    torch.testing.assert_close(kernels.silu_and_mul_ref(x), expected)
    assert math.isclose(float(kernels.silu_and_mul_ref(torch.tensor([[-200.0, 1.0]]))[0, 0]), 0.0, abs_tol=1e-30)
