"""Reading result streams (producer_sdk/core/reads.py, with its XREAD reply shapes): one read
over many jobs brings every stream a worker wrote together."""

from __future__ import annotations

import threading
import time

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import Keys


def test_merge_xreads_keeps_the_longer_read_per_stream():
    """The follow-up read behind a blocking XREAD (RESP2 list or RESP3 map) fills in streams
    the blocking answer left out; per stream the longer entry list wins."""
    from tokenrelay.producer_sdk.core.reads import merge_xreads
    e1, e2 = (b"1-0", {b"data": b"a"}), (b"2-0", {b"data": b"b"})
    blocking = [[b"s1", [e1]]]
    follow_up = {b"s1": [[e1, e2]], b"s2": [[e1]]}
    got = dict(merge_xreads(blocking, follow_up))
    assert got == {"s1": [e1, e2], "s2": [e1]}
    assert merge_xreads(None, None) == []
    assert dict(merge_xreads([[b"s1", [e1, e2]]], [[b"s1", [e1]]])) == {"s1": [e1, e2]}


def test_one_wakeup_brings_every_stream_written_together(redis_server):
    """A multiplexed reader blocked on several result streams gets all of them from one call
    when a worker writes them in one script (Redis < 7.2 answers the blocked XREAD with the
    first stream only; the pipelined follow-up read brings the rest)."""
    r = redis_server.client()
    keys = Keys()
    streams = {keys.results(f"j{i}"): b"0-0" for i in range(5)}
    for key in streams:
        r.xadd(key, {"data": b"seed"})
    streams = {key: r.xrevrange(key, count=1)[0][0] for key in streams}
    write_all = "for i = 1, #KEYS do redis.call('XADD', KEYS[i], '*', 'data', 'x') end"
    got: list = []
    with Client(redis_server.url) as c:
        read = c._reader.read(streams, 5_000)
        reader = threading.Thread(target=lambda: got.extend(c._run(read)))
        reader.start()
        time.sleep(0.2)                          # let the XREAD block
        r.eval(write_all, len(streams), *streams)
        reader.join(10)
    assert sorted(k for k, entries in got if len(entries) == 1) == sorted(streams)
