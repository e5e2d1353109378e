"""A simulated device: a model whose forward pass takes a fixed time and releases the GIL
while it waits (as a CUDA sync does), with cheap deterministic logits.

``EngineConfig.simulated_device_ms`` (``tokenrelay worker --simulated-device-ms``) serves the
checkpoint's tokenizer and config with this model instead of its weights, so the whole
serving stack (scheduler, sampler, output processing, the worker, Redis) can be measured
around a GPU-like step on any machine: benchmarks/engine_overlap.py and
benchmarks/simulated_gpu.py. The text it writes means nothing.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class SimulatedDeviceModel:
    """Its forward sleeps ``device_s``; its logits put all mass on ``(7 * token + position)
    % vocab``, so greedy decoding is deterministic and every step's tokens differ."""

    def __init__(self, vocab_size: int, device_s: float) -> None:
        self.vocab_size = vocab_size
        self.device_s = device_s

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 kv_caches: Any) -> torch.Tensor:
        time.sleep(self.device_s)
        return torch.stack([input_ids, positions], dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        target = (hidden[:, 0] * 7 + hidden[:, 1]) % self.vocab_size
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), target] = 10.0
        return logits
