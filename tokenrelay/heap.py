"""The garbage collector's settings for tokenrelay's long-running processes: the worker, its
engine core's process and the gateway. One home for what they do and why.

Two costs, both measured:

- A full collection walks every live object, and a process holding a model has hundreds of
  thousands (torch, the tokenizer, the model's modules): 136 ms in the bench worker, a stall
  of every running stream. :func:`freeze_heap` moves what is alive once a process is ready
  out of the collector's generations, so collections only look at what its loop allocates.
- The loops allocate many short-lived objects a step (deltas, events, per-sequence lists)
  that outlive CPython's 700-allocation young collections, get promoted, and set off older
  collections. :func:`collect_young_less_often` collects the young generation every
  ``YOUNG_GC_THRESHOLD`` allocations. The gateway at 2,000 streams had about 23 full
  collections a run of the load benchmark (170 ms each on average, up to 500 ms, with no
  client's disconnect noticed meanwhile: a cancel's p99 of 3 to 21 engine steps, issue #42);
  with 10,000, no full collection over 5 ms and young ones under 60 ms. The engine core at
  256 sequences spent 1.60 ms a step on the host instead of 1.80-1.90
  (``python -m benchmarks.engine_overlap``).

``serve_heap`` does both; ``thaw_heap`` undoes the freeze when the process's loop ends.
"""

from __future__ import annotations

import gc

# Allocations between two young-generation collections (CPython's default: 700).
YOUNG_GC_THRESHOLD = 10_000


def collect_young_less_often() -> None:
    """Raise only the young generation's threshold; the older ones keep theirs."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)


def freeze_heap() -> None:
    """Collect once, then move every object alive now out of the collector's generations."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Hand the frozen objects back to the collector. Frozen objects are never collected, not
    even at interpreter exit, so without this, extension objects caught in reference cycles
    (triton's, imported by torch's compiler) outlive their modules and nanobind prints pages of
    "leaked instances" at exit."""
    gc.unfreeze()


def serve_heap() -> None:
    """A process about to serve: what it holds now is frozen, young collections are rarer."""
    collect_young_less_often()
    freeze_heap()
