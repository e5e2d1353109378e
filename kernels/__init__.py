"""Triton kernels for the paged engine, each beside a plain-torch reference (tensors in, tensors out).

The seven public ops match docs/contracts.md ("Ops behind attention_backend"); the engine's
"triton" backend imports this package lazily. Without a GPU, set TRITON_INTERPRET=1 before
importing it (tests/conftest.py does) to run the kernels in Triton's CPU interpreter.
"""

from kernels.activation import silu_and_mul
from kernels.decode_attention import paged_decode_attention
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.prefill_attention import paged_prefill_attention
from kernels.reference import (
    fused_add_rms_norm_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
    store_kv_ref,
)
from kernels.rotary import rotary
from kernels.store_kv import store_kv

OPS = (
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
)

__all__ = [*OPS, *(f"{name}_ref" for name in OPS), "OPS"]
