"""store_kv: scatter this step's K/V rows into the paged cache.

One program copies BLOCK_T tokens, all KV heads at once (a token's Hkv*D values are contiguous in
both the input rows and the cache slot), so the copy is a wide coalesced 2-D tile. Slot -1 (a
token whose K/V must not be stored, e.g. padding) masks the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.reference import store_kv_ref

__all__ = ["store_kv", "store_kv_ref"]

# Elements per program and warps: wide enough for full-bandwidth stores, few programs in the
# interpreter. 45-46% of copy at 2048 tokens on the H200 (16:18) whatever the elements (2048 to
# 8192) at 4 warps; the GPU check's kernel_roofline sweeps both.
ELEMS_PER_PROGRAM, NUM_WARPS = 8192, 4


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, key_stride, value_stride,
    ROW: tl.constexpr,          # Hkv * D, the values of one token
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.arange(0, BLOCK_ROW).to(tl.int64)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    mask = ((slot >= 0) & tok_ok)[:, None] & (col < ROW)[None, :]
    dst = slot[:, None] * ROW + col[None, :]
    # Both loads before either store: the whole call moves ~60 KB per SM at 2048 tokens, so it
    # is a few DRAM round trips long, and K's store no longer sits between K's and V's loads.
    k = tl.load(key_ptr + tok[:, None] * key_stride + col[None, :], mask=mask)
    val = tl.load(value_ptr + tok[:, None] * value_stride + col[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, val, mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    v.check_tensor("key", key, 3, v.FLOAT_DTYPES)
    dev = key.device
    v.check_tensor("value", value, 3, v.FLOAT_DTYPES, dev)
    v.check_kv_cache(k_cache, v_cache, dev)
    v.check_tensor("slot_mapping", slot_mapping, 1, v.INDEX_DTYPES, dev)
    num_blocks, block_size, heads, dim = k_cache.shape
    v.check_shape("key", key, (key.shape[0], heads, dim))
    v.check_shape("value", value, tuple(key.shape))
    v.check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    v.check_same_dtype("key, value and the caches", key, value, k_cache)
    v.check_rows_contiguous("key", key)
    v.check_rows_contiguous("value", value)
    v.check_contiguous("slot_mapping", slot_mapping)
    v.check_range("slot_mapping", slot_mapping, -1, num_blocks * block_size,
                  f"-1 or below num_blocks * block_size = {num_blocks * block_size}")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    block_row = v.next_pow2(row)
    block_t = max(1, min(v.next_pow2(num_tokens), ELEMS_PER_PROGRAM // block_row))
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens, key.stride(0), value.stride(0),
        ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row, num_warps=NUM_WARPS,
    )
