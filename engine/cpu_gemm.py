"""Pre-packed float32 GEMM for linear layers on CPU (MKL's packed ``sgemm``).

Why: at decode batch sizes (a few to a few dozen rows) a plain ``F.linear`` spends about as long
re-packing the weight into MKL's blocked layout as it does multiplying, on every call. Packing
each weight once at load time and calling MKL's ``gemm_compute`` on the packed copy measured
2-3x faster for 5-48 rows on the bench model's shapes (e.g. gate/up 3072x512 at 48 rows: 1.21 ->
0.60 ms; the 32000x512 LM head: 13.4 -> 7.9 ms), and the same at prefill sizes.

PyTorch exposes MKL's pack/compute pair as ``torch.ops.mkl._mkl_reorder_linear_weight`` and
``torch.ops.mkl._mkl_linear`` (what its CPU compiler uses for frozen float32 linears). The packed
layout is requested for one row count but does not depend on it, so one pack serves every batch
size; because that is a property of MKL rather than a documented promise, :func:`pack` checks a
packed weight against ``F.linear`` at several row counts and returns ``None`` (plain ``F.linear``
is used) if it ever disagrees, or when the build has no MKL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row count the pack is requested for: the middle of the decode batch sizes it speeds up most.
_PACK_ROWS = 48
# Row counts checked against F.linear before a pack is trusted (GEMV-sized, odd, decode, prefill).
_CHECK_ROWS = (1, 7, 48, 257)
# Reduction-order differences only: a wrong layout gives errors of the order of the values.
_CHECK_RTOL = 1e-4


def available() -> bool:
    """True when this torch build has MKL's packed GEMM."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl,
                                                                  "_mkl_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL-packed copy of a float32 CPU ``weight[out, in]``, or None where packing does not apply
    or does not reproduce ``F.linear``."""
    if (not available() or weight.device.type != "cpu" or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous()):
        return None
    with torch.inference_mode():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS)
        gen = torch.Generator().manual_seed(0)
        for rows in _CHECK_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            want = F.linear(x, weight)
            got = linear(x, packed, weight, None)
            scale = want.abs().max().clamp_min(1e-30)
            if got.shape != want.shape or not bool(((got - want).abs().max() / scale)
                                                   <= _CHECK_RTOL):
                return None
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D float32 ``x`` through the packed weight."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
