"""The decoder's linear layer: ``y = x W^T (+ b)``, with a packed copy of W on CPU float32.

Its own module so the tensor-parallel layers (tensor_parallel.py) can build on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.layers import cpu_gemm


def param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the loader.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` without nn.Linear's (slow, pointless) random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype, device=device)
        self.bias = param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: cpu_gemm.PackedWeight | None = None     # see prepack()

    def prepack(self, backend: str = "auto") -> bool:
        """Keep a packed copy of the weight for CPU float32 (cpu_gemm.py); the weight
        itself stays, for other row layouts and for whoever else reads it."""
        self.packed = cpu_gemm.pack(self.weight, self.bias, backend)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] > 0:
            return cpu_gemm.linear(x, self.packed, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
