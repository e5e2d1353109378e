"""The seven ops the decoder calls, chosen by backend name so Triton kernels can be swapped in.

Signatures are fixed by docs/contracts.md; ``"torch"`` uses torch_ops.py/attention.py,
``"triton"`` imports ``tokenrelay.kernels`` lazily (so a CPU-only install never needs Triton),
``"auto"`` is Triton when CUDA is available (an error naming the cause when the kernels cannot
load: never a silent torch path on a GPU) and the torch ops elsewhere.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from tokenrelay.engine.layers import attention, torch_ops
from tokenrelay.engine.layers.attention import AttentionMetadata
from tokenrelay.engine.layers.attention_plan import AttentionPlan

OP_NAMES = ("store_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
            "fused_add_rms_norm", "rotary", "silu_and_mul")
BACKENDS = ("torch", "triton", "auto")


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot be used in this install."""


@dataclass(frozen=True)
class Ops:
    """Callables with the contract's signatures, and how a step's attention reaches them."""

    name: str
    store_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    # The torch attention functions split each step's batch by an AttentionPlan (``plan=``);
    # the triton kernels read the block tables on the device and take none.
    uses_plan: bool = False
    # Checks a step's index values on the host, once per step, for ops that never read them
    # themselves (the triton kernels: each read would be a device sync per layer). Keywords:
    # slot_mapping, block_tables, seq_lens, cu_seqlens_q (host tensors), num_blocks, block_size.
    check_step: Callable[..., None] | None = None

    def plan_step(self, meta: AttentionMetadata, block_size: int,
                  dtype: torch.dtype) -> AttentionPlan | None:
        """The step's attention plan for these ops (None where they need none). The
        ModelRunner calls this once per step and stores the result in ``meta.plan``."""
        if not self.uses_plan:
            return None
        cu = None if meta.is_decode else meta.cu_seqlens_q
        return AttentionPlan.for_step(meta.block_tables, meta.seq_lens, cu, block_size, dtype)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A layer's attention over the step: the decode op when every sequence has one new
        token, the prefill op otherwise, given the step's plan where these ops use one."""
        plan = {"plan": meta.plan} if self.uses_plan else {}
        if meta.is_decode:
            return self.paged_decode_attention(query, k_cache, v_cache, meta.block_tables,
                                               meta.seq_lens, scale, **plan)
        return self.paged_prefill_attention(query, k_cache, v_cache, meta.block_tables,
                                            meta.seq_lens, meta.cu_seqlens_q, scale, **plan)


def _torch_ops() -> Ops:
    return Ops(name="torch", store_kv=attention.store_kv,
               paged_decode_attention=attention.paged_decode_attention,
               paged_prefill_attention=attention.paged_prefill_attention,
               rms_norm=torch_ops.rms_norm, fused_add_rms_norm=torch_ops.fused_add_rms_norm,
               rotary=torch_ops.rotary, silu_and_mul=torch_ops.silu_and_mul, uses_plan=True)


def _triton_ops() -> Ops:
    try:
        kernels = importlib.import_module("tokenrelay.kernels.ops")
        found = {n: getattr(kernels, n) for n in OP_NAMES}
        check_step = kernels.check_step_values
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"backend 'triton' cannot load tokenrelay's Triton kernels ({type(exc).__name__}: "
            f"{exc}); install the gpu extra (triton), or run attention_backend='torch'") from exc
    return Ops(name="triton", check_step=check_step, **found)


def _compiled_torch_ops() -> Ops:
    """The torch ops, named "torch-compiled": decode attention through the inductor kernel, and
    the decoder does Q/K norm + RoPE in one compiled kernel (CPU float32; other dtypes and
    devices, and a host where compiling fails, keep the eager path)."""
    ops = _torch_ops()
    return replace(ops, name="torch-compiled",
                   paged_decode_attention=functools.partial(attention.paged_decode_attention,
                                                            compiled=True),
                   paged_prefill_attention=functools.partial(attention.paged_prefill_attention,
                                                             compiled=True))


def get_ops(backend: str = "torch", compiled: bool = False) -> Ops:
    """Return the op table for ``backend`` ("torch" | "triton" | "auto"). ``compiled`` asks for
    the compiled CPU kernels wherever the torch ops are chosen."""
    if backend == "torch":
        return _compiled_torch_ops() if compiled else _torch_ops()
    if backend == "triton":
        return _triton_ops()
    if backend == "auto":
        # On a GPU "auto" means the Triton kernels: a GPU quietly running the torch path is
        # several times slower with nothing said, so a kernel that cannot load is an error that
        # names the cause (BackendUnavailableError); attention_backend='torch' opts out.
        if torch.cuda.is_available():
            return _triton_ops()
        return _compiled_torch_ops() if compiled else _torch_ops()
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")

