"""The one dead-letter writer (worker/deadletters.py, script DEAD_LETTER) against real
redis-server processes, Redis 7 and 6.2: the letter, the job's error event, never after a
terminal event."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import PAYLOAD_FIELD
from tokenrelay.protocol.wire import JobRequest, decode_event, encode_job
from tests.worker.redis_layer import (dead_letter, enqueue, keeper, keys, pending,  # noqa: F401
                                      r, read_as)
from tokenrelay.worker.pending import AckStatus

pytestmark = pytest.mark.timeout(60)


def test_dead_letter_writes_the_letter_and_the_poison_error_then_ack(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "poison", prompt="boom")
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    entry.deliveries = 4
    assert dead_letter(r, keys, "b", entry) == "written"
    assert keeper(r, keys, "b").ack([entry.key]) == [AckStatus.ACKED]
    assert pending(r, lane, eid) is None
    assert r.xrange(lane, eid, eid) == []            # acked = XACK + XDEL
    (dead_id, dead), = r.xrange(keys.dead())
    assert dead[b"job_id"] == b"poison" and dead[b"entry_id"].decode() == eid
    assert dead[b"deliveries"] == b"4"
    assert dead[PAYLOAD_FIELD] == encode_job(JobRequest(job_id="poison", prompt="boom"))
    events = [decode_event(f[PAYLOAD_FIELD]) for _, f in r.xrange(keys.results("poison"))]
    assert [(e.type, e.code) for e in events] == [("error", "poison")]
    assert 0 < r.pttl(keys.results("poison")) <= 60_000
    assert r.get(keys.owner("poison")).startswith(b"b:")


def test_poison_error_is_not_written_after_a_terminal_event(r, keys):
    from tokenrelay.protocol.events import DoneEvent, encode_event
    enqueue(r, keys, "finished")
    r.xadd(keys.results("finished"), {PAYLOAD_FIELD: encode_event(DoneEvent(finish_reason="stop"))})
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    assert dead_letter(r, keys, "b", entry) == "ended"
    events = [decode_event(f[PAYLOAD_FIELD]) for _, f in r.xrange(keys.results("finished"))]
    assert [e.type for e in events] == ["done"]
