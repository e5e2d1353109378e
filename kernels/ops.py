"""Triton kernels for the paged engine, each beside a plain-torch reference (tensors in, tensors out).

The seven public ops match docs/contracts.md ("Ops behind attention_backend"); the engine's
"triton" backend imports this package lazily. The ops read no tensor value on the host (a device
sync each); ``check_step_values`` checks a step's indices once, on the host, instead. Without a GPU, set TRITON_INTERPRET=1 before the
first op is touched (tests/conftest.py does; `python -m benchmarks.kernels` does) to run the kernels in
Triton's CPU interpreter. Exports resolve lazily so that importing the package (or running
`python -m benchmarks.kernels`) does not import any @triton.jit module before that choice is made.
"""

from __future__ import annotations

from tokenrelay._lazy import lazy_exports

OPS = (
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
)

_HOME = {
    "store_kv": "tokenrelay.kernels.store_kv",
    "paged_decode_attention": "tokenrelay.kernels.decode_attention",
    "paged_prefill_attention": "tokenrelay.kernels.prefill_attention",
    "rms_norm": "tokenrelay.kernels.norm",
    "fused_add_rms_norm": "tokenrelay.kernels.norm",
    "rotary": "tokenrelay.kernels.rotary",
    "silu_and_mul": "tokenrelay.kernels.activation",
    **{f"{name}_ref": "tokenrelay.kernels.reference" for name in OPS},
    "check_step_values": "tokenrelay.kernels._validate",
}

__all__ = [*OPS, *(f"{name}_ref" for name in OPS), "OPS", "check_step_values"]

__getattr__, __dir__ = lazy_exports(__name__, _HOME, globals())
