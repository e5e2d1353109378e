"""A streamed answer sends the events of one wake as one chunk: one send and one socket write
per wake, not per event (at 2,000 streams a wake carries several deltas, and the sends were
CPU that made every turn of the gateway's loop slower, a disconnect's noticing among them;
issue #42). The bytes are the same; only where the chunks are cut changes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tokenrelay.producer_sdk.gateway.responses import _END, event_stream

pytestmark = pytest.mark.timeout(30)


class Feed:
    """Two wakes (three deltas, then one), then the end."""

    def __init__(self) -> None:
        self.items: list[Any] = [["b"], _END]
        self.ended = False
        self.on_close = None
        self.closed = 0
        self.job = SimpleNamespace(id="job")

    async def next(self, timeout: float) -> Any:
        item = self.items.pop(0)
        self.ended = item is _END
        return item

    def close(self) -> None:
        self.closed += 1


class Renderer:
    """One SSE event per delta, a closing event and ``[DONE]``."""

    metrics = SimpleNamespace(cancelled=SimpleNamespace(inc=lambda: None))

    def deltas(self, deltas: list[str]) -> list[str]:
        return [f"data: {d}\n\n" for d in deltas]

    def ending(self) -> list[str]:
        return ["data: end\n\n", "data: [DONE]\n\n"]


async def chunks() -> tuple[list[str], int]:
    feed = Feed()
    first = ["a1", "a2", "a3"]
    out = [c async for c in event_stream(Renderer(), feed, ["data: ready\n\n"], first, 1.0)]
    return out, feed.closed


def test_the_events_of_one_wake_go_out_as_one_chunk() -> None:
    out, closed = asyncio.run(chunks())
    assert out == ["data: ready\n\n", "data: a1\n\ndata: a2\n\ndata: a3\n\n", "data: b\n\n",
                   "data: end\n\ndata: [DONE]\n\n"]
    assert closed == 1
