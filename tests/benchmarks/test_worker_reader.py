"""The worker benchmark's reader takes every event once: a round's blocking read and the
non-blocking read behind it both answer with the entries after the same ids."""

from __future__ import annotations

import msgpack
import pytest

from benchmarks.worker import Reader
from tokenrelay.protocol.keys import EVENT_FIELD, Keys


def entry(i: int, kind: str = "token") -> tuple[bytes, list[bytes]]:
    ev = {"type": kind, "ts": 100.0, "token_ids": [i]} if kind == "token" else {"type": kind}
    return (f"1-{i}".encode(), [EVENT_FIELD, msgpack.packb(ev), b"$batch", b"b:1"])


@pytest.mark.timeout(30)
def test_a_round_counts_each_entry_once_and_waits_next_on_the_live_streams():
    reader = Reader("redis://127.0.0.1:1/0", Keys(), ["a", "b", "c"])
    a, b, c = (Keys().results(j) for j in "abc")
    seen = reader._take([[a.encode(), [entry(1)]]], 100.001, {})        # the blocking read
    reader._take([[a.encode(), [entry(1), entry(2)]], [b.encode(), [entry(3)]]], 100.002,
                 seen)                                                  # the rest of them
    assert reader.tokens == 3 and len(reader.delays) == 3
    assert reader.last[a] == "1-2" and reader.last[b] == "1-3" and reader.last[c] == "0-0"
    assert reader.live == [a, b]
    reader._take([[b.encode(), [entry(4, "done")]]], 100.003, {})
    assert reader.open == {a, c}
