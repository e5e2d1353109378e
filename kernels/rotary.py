"""rotary: in-place rotary position embedding of q and k.

One program per token rotates all of that token's query and key heads, so the token's cos/sin row
is loaded once and shared by every head. The cache row is [cos half | sin half] of R/2 values
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

from kernels import _validate as v
from kernels.reference import rotary_ref

__all__ = ["rotary", "rotary_ref"]


@triton.jit
def _rotate_heads(
    base_ptr, head_stride, cos, sin, i, i_ok,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (h < NUM_HEADS)[:, None] & i_ok[None, :]
    if IS_NEOX:
        first, second = i, i + HALF
    else:
        first, second = 2 * i, 2 * i + 1
    p1 = base_ptr + h[:, None] * head_stride + first[None, :]
    p2 = base_ptr + h[:, None] * head_stride + second[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    i_ok = i < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * q_stride_t, q_stride_h, cos, sin, i, i_ok, NUM_Q, BLOCK_HQ, HALF, IS_NEOX)
    _rotate_heads(k_ptr + t * k_stride_t, k_stride_h, cos, sin, i, i_ok, NUM_K, BLOCK_HK, HALF, IS_NEOX)


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
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q=q.shape[1], NUM_K=k.shape[1], HALF=half,
        BLOCK_HQ=v.next_pow2(q.shape[1]), BLOCK_HK=v.next_pow2(k.shape[1]),
        BLOCK_HALF=v.next_pow2(half), IS_NEOX=bool(is_neox),
        num_warps=4,
    )
