"""A simulated device: a model whose forward pass takes a fixed time of device work, queued on
a simulated stream that behaves as a CUDA stream does, with cheap deterministic logits.

``EngineConfig.simulated_device_ms`` (``tokenrelay worker --simulated-device-ms``) serves the
checkpoint's tokenizer and config with this model instead of its weights, so the whole
serving stack (scheduler, sampler, output processing, the worker, Redis) can be measured
around a GPU-like step on any machine: benchmarks/engine_overlap.py and
benchmarks/simulated_gpu.py. The text it writes means nothing.

Why a stream and not a thread: on a GPU the host's Python (preparing inputs, launching
kernels, the sampler's launches) runs on the host thread and the device works through its
queue meanwhile; the host waits (and releases the GIL) only where it reads a result. A
background thread that ran the step's Python *and* its wait put that Python behind the GIL
of the thread scheduling the next step: the "device" then idled waiting for the GIL (1.2 ms
of a 2 ms step at 256 sequences), a cost no GPU has. So the step's Python runs where it would
on a GPU, and the device time runs on :class:`SimulatedStream`'s clock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch


class SimulatedStream:
    """The simulated device's work queue. ``launch(seconds)`` queues device work behind what is
    queued already; outside :meth:`deferred` the caller then waits for it, as a serial step
    reads its logits at once (a sync); inside, the caller goes on and waits later
    (:meth:`wait_until` a launch's ``ready_at``), as an overlapped core does. Waits sleep, so
    they release the GIL as a CUDA sync does."""

    def __init__(self) -> None:
        self.ready_at = 0.0         # perf_counter time when all queued work is done
        self.busy_s = 0.0           # device seconds launched so far
        self._deferred = False

    def launch(self, seconds: float) -> None:
        self.ready_at = max(self.ready_at, time.perf_counter()) + seconds
        self.busy_s += seconds
        if not self._deferred:
            self.wait_until(self.ready_at)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Launches inside return at once; the caller waits with ``wait_until``."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    @staticmethod
    def wait_until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class SimulatedDeviceModel:
    """Its forward launches ``device_s`` of work on :attr:`stream`; its logits put all mass on
    ``(7 * token + position) % vocab``, so greedy decoding is deterministic and every step's
    tokens differ."""

    def __init__(self, vocab_size: int, device_s: float) -> None:
        self.vocab_size = vocab_size
        self.device_s = device_s
        self.stream = SimulatedStream()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 kv_caches: Any) -> torch.Tensor:
        self.stream.launch(self.device_s)
        return torch.stack([input_ids, positions], dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        target = (hidden[:, 0] * 7 + hidden[:, 1]) % self.vocab_size
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), target] = 10.0
        return logits
