"""rotary: in-place rotary position embedding of q and k.

One program rotates all query and key heads of BLOCK_T tokens, so each token's cos/sin row is
loaded once and shared by every head. The cache row is [cos half | sin half] of R/2 values
each; the first R dims of every head rotate (R = cache width, normally head_dim) and the rest
pass through untouched (partial rotary). Styles:
- neox: pairs (i, i + R/2) — the halves layout (Llama, Qwen).
- gpt-j: pairs (2i, 2i + 1) — interleaved.
q and k may be views of a fused qkv projection: only the head_dim axis must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.reference import rotary_ref

__all__ = ["rotary", "rotary_ref"]

# Query-head elements per program (4096: 2 tokens of 32 heads x 64 pairs) and warps. 69% of
# copy at 2048 tokens on the H200 (16:18); the GPU check's kernel_roofline section sweeps both.
ELEMS_PER_PROGRAM, NUM_WARPS = 4096, 4


@triton.jit
def _rotate_heads(
    x_ptr, token_stride, head_stride, tok, tok_ok, cos, sin, i, i_ok,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    """Rotate heads [BLOCK_T, BLOCK_H, BLOCK_HALF] of BLOCK_T tokens; cos/sin are [BLOCK_T, BLOCK_HALF]."""
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = tok_ok[:, None, None] & (h < NUM_HEADS)[None, :, None] & i_ok[None, None, :]
    if IS_NEOX:
        first, second = i, i + HALF
    else:
        first, second = 2 * i, 2 * i + 1
    base = x_ptr + tok[:, None, None] * token_stride + h[None, :, None] * head_stride
    p1 = base + first[None, None, :]
    p2 = base + second[None, None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr, num_tokens,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_ok = tok < num_tokens
    pos = tl.load(pos_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    i_ok = i < HALF
    cs_mask = tok_ok[:, None] & i_ok[None, :]
    row = cache_ptr + pos[:, None] * cache_stride + i[None, :]
    cos = tl.load(row, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_stride_t, q_stride_h, tok, tok_ok, cos, sin, i, i_ok,
                  NUM_Q, BLOCK_HQ, HALF, IS_NEOX)
    _rotate_heads(k_ptr, k_stride_t, k_stride_h, tok, tok_ok, cos, sin, i, i_ok,
                  NUM_K, BLOCK_HK, HALF, IS_NEOX)


def _check(q, k, positions, cos_sin_cache) -> None:
    v.check_tensor("q", q, 3, v.FLOAT_DTYPES)
    dev = q.device
    v.check_tensor("k", k, 3, v.FLOAT_DTYPES, dev)
    v.check_tensor("positions", positions, 1, v.INDEX_DTYPES, dev)
    v.check_tensor("cos_sin_cache", cos_sin_cache, 2, v.FLOAT_DTYPES, dev)
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    v.check_shape("positions", positions, (num_tokens,))
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim or rot == 0:
        raise ValueError(f"cos_sin_cache width {rot} must be even, positive and <= head_dim {head_dim}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (strides {t.stride()})")
    v.check_contiguous("positions", positions)
    v.check_contiguous("cos_sin_cache", cos_sin_cache)
    v.check_range("positions", positions, 0, cos_sin_cache.shape[0],
                  f"cos_sin_cache has {cos_sin_cache.shape[0]} rows")


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by positions [T] (cache [max_pos, R])."""
    _check(q, k, positions, cos_sin_cache)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_hq, block_hk, block_half = v.next_pow2(q.shape[1]), v.next_pow2(k.shape[1]), v.next_pow2(half)
    block_t = max(1, min(v.next_pow2(num_tokens), ELEMS_PER_PROGRAM // (block_hq * block_half)))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, positions, cos_sin_cache, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q=q.shape[1], NUM_K=k.shape[1], HALF=half, BLOCK_T=block_t,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, IS_NEOX=bool(is_neox),
        num_warps=NUM_WARPS,
    )
