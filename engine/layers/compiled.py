"""Lazily compiled torch functions for the CPU float32 path, with a fallback that never breaks
serving.

torch.compile (inductor) turns a chain of tensor ops into one C++ loop nest; on CPU that pays
where the eager ops are memory-bound or many and small (decode attention over the paged cache,
Q/K norm + RoPE). The price is a C++ compiler at run time and seconds of compiling per process,
which the ModelRunner pays at start-up. If compiling fails (no compiler, an inductor bug) the
failure is logged once and the caller's eager path takes over for the rest of the process.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


class LazyCompiled:
    """``torch.compile(fn)``, built on first call. ``__call__`` returns None when compiling is
    not possible here, and the caller runs its eager path instead."""

    def __init__(self, fn: Callable[..., Any], what: str) -> None:
        self.fn = fn
        self.what = what
        self.failed: str | None = None
        self.calls = 0                      # calls that ran compiled code (tests read this)
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def _get(self) -> Callable[..., Any]:
        with self._lock:
            if self._compiled is None:
                import torch._dynamo
                # One graph per static configuration (head layout, dtype, constants); a process
                # that serves several models (the test suite) must not hit dynamo's default
                # limit of 8 graphs, past which it would run ``fn`` eagerly.
                cfg = torch._dynamo.config
                cfg.recompile_limit = max(cfg.recompile_limit, 64)
                self._compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
            return self._compiled

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return None
        try:
            out = self._get()(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("compiled %s unavailable, using the eager path: %s", self.what,
                        self.failed.splitlines()[0][:300])
            return None
        self.calls += 1
        return out


def mark_dynamic(t: torch.Tensor, *dims: int) -> None:
    """One graph whatever these sizes (they must be >= 2: dynamo specializes 0 and 1)."""
    for d in dims:
        torch._dynamo.mark_dynamic(t, d)
