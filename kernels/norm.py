"""rms_norm and fused_add_rms_norm.

One program normalizes BLOCK_T whole rows (the hidden size fits one tile up to 16K), so the mean of
squares is a single in-register reduction. The fused variant exists because every decoder layer
does "residual += x; h = norm(residual)" twice: fusing saves a full read and write of the residual
stream. The residual is rounded to its dtype before it is normalized, exactly as an unfused
`residual += x` followed by `norm(residual)` would see it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_ref", "fused_add_rms_norm_ref"]

_MAX_HIDDEN = 16384
# Elements per program (whole rows: 4096 is one Llama-3-8B row) and warps (doubled for rows
# over 4096). 63% of copy for rms_norm, 84% for the fused op at 2048 x 4096 on the H200 (16:18);
# the GPU check's kernel_roofline section sweeps both.
ELEMS_PER_PROGRAM, NUM_WARPS = 4096, 4


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    num_rows, x_stride, res_stride, out_stride, eps,
    HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.arange(0, BLOCK_H).to(tl.int64)
    col_ok = cols < HIDDEN
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None] * res_stride + cols[None, :]
        res = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HIDDEN + eps)
    y = x * inv[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
    v.check_tensor("x", x, 2, v.FLOAT_DTYPES)
    v.check_tensor("weight", weight, 1, v.FLOAT_DTYPES, x.device)
    v.check_shape("weight", weight, (x.shape[1],))
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x rows and weight must be contiguous along the hidden dim")
    if x.shape[1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} > {_MAX_HIDDEN} (one row per tile)")
    if not (eps > 0):
        raise ValueError(f"eps must be positive, got {eps}")
    if residual is not None:
        v.check_tensor("residual", residual, 2, v.FLOAT_DTYPES, x.device)
        v.check_shape("residual", residual, tuple(x.shape))
        if residual.stride(1) != 1:
            raise ValueError("residual rows must be contiguous along the hidden dim")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    num_rows, hidden = x.shape
    out = v.new_buffer((num_rows, hidden), x.dtype, x.device)
    if num_rows == 0:
        return out
    block_h = v.next_pow2(hidden)
    block_t = max(1, min(v.next_pow2(num_rows), ELEMS_PER_PROGRAM // block_h))
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
        x, res, weight, out,
        num_rows, x.stride(0), res.stride(0), out.stride(0), float(eps),
        HIDDEN=hidden, BLOCK_T=block_t, BLOCK_H=block_h, ADD_RESIDUAL=residual is not None,
        num_warps=NUM_WARPS if block_h <= 4096 else 2 * NUM_WARPS,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, in x's dtype (fp32 inside)."""
    _check(x, weight, eps, None)
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x in place; returns rms_norm(residual) in x's dtype."""
    _check(x, weight, eps, residual)
    return _launch(x, residual, weight, eps)
