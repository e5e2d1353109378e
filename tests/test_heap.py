"""tokenrelay/heap.py: the collector's settings the worker, its engine core's process and the
gateway serve under."""

from __future__ import annotations

import gc

import pytest

from tokenrelay.heap import YOUNG_GC_THRESHOLD, serve_heap, thaw_heap

pytestmark = pytest.mark.timeout(60)


def test_serve_heap_freezes_what_is_alive_and_collects_the_young_less_often():
    before = gc.get_threshold()
    held = [object() for _ in range(1000)]
    try:
        gc.set_threshold(700, 10, 10)                 # CPython's defaults
        serve_heap()
        assert gc.get_freeze_count() >= len(held)
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, 10, 10)
        assert YOUNG_GC_THRESHOLD > 700
        thaw_heap()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
