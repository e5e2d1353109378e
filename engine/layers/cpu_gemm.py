"""Pre-packed float32 GEMM for linear layers on CPU: oneDNN or MKL, whichever this CPU runs faster.

Why pack: at decode batch sizes (a few to a few dozen rows) a plain ``F.linear`` spends about as
long re-packing the weight into the BLAS's blocked layout as it does multiplying, on every call.
Packing each weight once at load time and multiplying by the packed copy measured 2-3x faster
for 5-48 rows on the bench model's shapes.

PyTorch exposes two packed GEMMs, both what its CPU compiler uses for frozen float32 linears:

- oneDNN: ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``;
- MKL: ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``.

Which is faster depends on the CPU, by a lot: on an AVX2 AMD EPYC, MKL ran the bench's 32000 x
512 LM head at 48 rows in 31-43 ms and oneDNN in 13.5 ms (MKL does not pick its fast kernels on
AMD); on an AVX-512 Intel host MKL ran it in 7.9 ms. So ``backend="auto"`` packs with each
available backend and times them once per weight shape at a decode-sized batch (a few tenths of
a second per model, most of it the LM head), keeping the faster. Either way the result is the
same GEMM up to summation order.

A packed layout is requested for one row count but serves every row count; because that is a
property of the libraries rather than a documented promise, :func:`pack` checks every packed
weight against ``F.linear`` at several row counts and refuses a backend that ever disagrees
(plain ``F.linear`` is used when none is left).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("onednn", "mkl")
# Row count the pack is requested for: the middle of the decode batch sizes it speeds up most.
_PACK_ROWS = 48
# Row counts checked against F.linear before a pack is trusted (GEMV-sized, odd, decode, prefill).
_CHECK_ROWS = (1, 7, 48, 257)
# Reduction-order differences only: a wrong layout gives errors of the order of the values.
_CHECK_RTOL = 1e-4
# Rows timed by "auto": a decode step (the calls that dominate serving; at prefill sizes the
# backends measured within ~10% of each other).
_TUNE_ROWS = 32
_TUNE_ROUNDS = 5
_TUNE_CALLS = 3

# "auto" decisions per (out, in, bias, threads): the layers of a model share a few shapes.
_CHOSEN: dict[tuple[int, int, bool, int], str | None] = {}


@dataclass(frozen=True)
class PackedWeight:
    """A weight in one backend's blocked layout (MKL's call also takes the original weight, which
    the caller keeps)."""

    backend: str
    data: torch.Tensor


def available(backend: str | None = None) -> bool:
    """True when this torch build has the named packed GEMM (any of them when None)."""
    if backend is None:
        return any(available(b) for b in BACKENDS)
    if backend == "onednn":
        return (bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)())
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if backend == "mkl":
        return bool(getattr(torch._C, "has_mkl", False)) and hasattr(
            torch.ops.mkl, "_mkl_reorder_linear_weight")
    raise ValueError(f"unknown CPU GEMM backend {backend!r}; known: {', '.join(BACKENDS)}")


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None,
         backend: str = "auto") -> PackedWeight | None:
    """A packed copy of a float32 CPU ``weight[out, in]`` with the named backend (or, for
    "auto", the faster one here), or None where packing does not apply or no backend
    reproduces ``F.linear``."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"cpu GEMM backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if (weight.device.type != "cpu" or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous()):
        return None
    names = BACKENDS if backend == "auto" else (backend,)
    key = (weight.shape[0], weight.shape[1], bias is not None, torch.get_num_threads())
    if backend == "auto" and key in _CHOSEN:
        names = () if _CHOSEN[key] is None else (_CHOSEN[key],)
    with torch.inference_mode():
        packs = [p for p in (_checked_pack(weight, bias, name) for name in names
                             if available(name)) if p is not None]
        best = _fastest(packs, weight, bias) if len(packs) > 1 else (packs[0] if packs else None)
    if backend == "auto":
        _CHOSEN[key] = None if best is None else best.backend
    return best


def linear(x: torch.Tensor, packed: PackedWeight, weight: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D float32 ``x`` through the packed weight."""
    if packed.backend == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed.data, weight, bias, x.shape[0])


def _raw_pack(weight: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS)


def _checked_pack(weight: torch.Tensor, bias: torch.Tensor | None,
                  backend: str) -> PackedWeight | None:
    try:
        packed = PackedWeight(backend, _raw_pack(weight, backend))
    except RuntimeError:        # a build whose kernels refuse this shape or CPU
        return None
    gen = torch.Generator().manual_seed(0)
    for rows in _CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen)
        want = F.linear(x, weight, bias)
        got = linear(x, packed, weight, bias)
        scale = want.abs().max().clamp_min(1e-30)
        if got.shape != want.shape or not bool(((got - want).abs().max() / scale) <= _CHECK_RTOL):
            return None
    return packed


def _fastest(packs: list[PackedWeight], weight: torch.Tensor,
             bias: torch.Tensor | None) -> PackedWeight:
    """The pack with the least best-of-N time at a decode-sized batch.

    Backends take turns, so a slower moment of a shared host falls on both."""
    x = torch.randn(_TUNE_ROWS, weight.shape[1])
    for p in packs:
        linear(x, p, weight, bias)                  # first call: the library's own set-up
    best = [float("inf")] * len(packs)
    for _ in range(_TUNE_ROUNDS):
        for i, p in enumerate(packs):
            best[i] = min(best[i], _time(p, x, weight, bias))
    return packs[best.index(min(best))]


def _time(packed: PackedWeight, x: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None) -> float:
    start = time.perf_counter()
    for _ in range(_TUNE_CALLS):
        linear(x, packed, weight, bias)
    return time.perf_counter() - start
