"""silu_and_mul: the gated-MLP activation silu(gate) * up over a fused [gate | up] projection.

Fusing saves materializing silu(gate) (one full write + read of a [T, I] tensor). The silu is
computed as g / (1 + exp(-g)) in fp32, which is exact at both tails (exp overflow gives 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.reference import silu_and_mul_ref

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, num_rows, x_stride, out_stride,
    INTER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    mask = (rows < num_rows)[:, None] & (cols < INTER)[None, :]
    base = x_ptr + rows[:, None] * x_stride + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + INTER, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I] in x's dtype."""
    v.check_tensor("x", x, 2, v.FLOAT_DTYPES)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"x width {width} must be even ([gate | up])")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous along its last dim (strides {x.stride()})")
    inter = width // 2
    out = v.new_buffer((num_rows, inter), x.dtype, x.device)
    if num_rows == 0 or inter == 0:
        return out
    block_i = min(v.next_pow2(inter), 1024)
    block_t = max(1, min(v.next_pow2(num_rows), 4096 // block_i))
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](
        x, out, num_rows, x.stride(0), out.stride(0),
        INTER=inter, BLOCK_T=block_t, BLOCK_I=block_i, num_warps=4,
    )
    return out
