"""The token budget's release, against real redis-server processes (Redis 7 and 6.2): the
script writing a job's terminal event subtracts the cost its entry carries exactly once (a
retried batch that landed releases nothing more), the dead-letter write does the same with its
error event, and nothing else releases anything (protocol/scripts/results.py)."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.budget import job_cost
from tokenrelay.protocol.events import DoneEvent, encode_event
from tokenrelay.protocol.keys import COST_FIELD, PAYLOAD_FIELD
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.protocol.wire import JobRequest, encode_job
from tests.worker.redis_layer import dead_letter, keeper, keys, r, read_as  # noqa: F401
from tokenrelay.worker.fencing import Fence, WriteStatus, parse_step_reply

pytestmark = pytest.mark.timeout(60)


def enqueue_costed(r, keys, job_id: str, cost: int) -> str:
    """An entry as the SDK's enqueue writes it (payload and cost), its cost admitted."""
    payload = encode_job(JobRequest(job_id=job_id, prompt="hi"))
    r.incrby(keys.budget(), cost)
    return r.xadd(keys.lane("default"), {PAYLOAD_FIELD: payload, COST_FIELD: cost}).decode()


def budget(r, keys) -> int:
    return int(r.get(keys.budget()) or 0)


def write(r, keys, job: str, batch: str, events: list[bytes], release: int,
          known: int = 0, create: bool = True) -> WriteStatus:
    pipe = ScriptPipeline(r)
    Fence(keys).write_step(pipe, 60_000, 0, [(job, "w1:a", batch, events, create, known, True)],
                           [release])
    (reply,) = pipe.execute()
    return parse_step_reply(reply)[0][0]


def test_the_terminal_write_releases_the_cost_once(r, keys):
    eid = enqueue_costed(r, keys, "j", 40)
    enqueue_costed(r, keys, "other", 7)
    read_as(r, keys, "w1")
    (entry, _) = keeper(r, keys, "w1").read_own_pending()
    assert entry.entry_id == eid and entry.cost == 40
    r.set(keys.owner("j"), "w1:a")
    assert write(r, keys, "j", "b.0", [b"started", b"t0"], 0) is WriteStatus.OK
    assert budget(r, keys) == 47                         # no terminal event: nothing released
    done = encode_event(DoneEvent(finish_reason="stop"))
    assert write(r, keys, "j", "b.1", [b"t1", done], entry.cost, known=2,
                 create=False) is WriteStatus.OK
    assert budget(r, keys) == 7
    # the reply was lost: the same batch again, checked, lands nothing and releases nothing
    assert write(r, keys, "j", "b.1", [b"t1", done], entry.cost, known=2,
                 create=False) is WriteStatus.DUP
    assert budget(r, keys) == 7
    # a stale writer (another owner took the job) is refused and releases nothing
    r.set(keys.owner("other"), "w2:b")
    assert write(r, keys, "other", "c.0", [done], 7) is WriteStatus.REFUSED
    assert budget(r, keys) == 7


def test_a_batch_that_landed_half_way_releases_when_its_rest_lands(r, keys):
    enqueue_costed(r, keys, "j", 25)
    r.set(keys.owner("j"), "w1:a")
    done = encode_event(DoneEvent(finish_reason="length"))
    r.xadd(keys.results("j"), {"data": b"t0", "b": b"b.0:1"})     # died after event 1 of 2
    assert write(r, keys, "j", "b.0", [b"t0", done], 25, known=0,
                 create=False) is WriteStatus.OK
    assert budget(r, keys) == 0


def test_the_dead_letter_releases_with_its_error_event_not_after_a_terminal_one(r, keys):
    enqueue_costed(r, keys, "poison", 30)
    enqueue_costed(r, keys, "finished", 12)
    r.xadd(keys.results("finished"), {PAYLOAD_FIELD: encode_event(DoneEvent(finish_reason="stop"))})
    read_as(r, keys, "b")
    poison, finished = keeper(r, keys, "b").read_own_pending()
    assert dead_letter(r, keys, "b", poison) == "written"
    assert budget(r, keys) == 12
    assert dead_letter(r, keys, "b", finished) == "ended"     # released by its terminal write
    assert budget(r, keys) == 12


def test_an_entry_without_a_cost_releases_nothing(r, keys):
    r.set(keys.budget(), 5)
    r.xadd(keys.lane("default"), {PAYLOAD_FIELD: encode_job(JobRequest(job_id="raw", prompt="x"))})
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    assert entry.cost == 0
    assert dead_letter(r, keys, "b", entry) == "written"
    assert budget(r, keys) == 5
    assert job_cost({"prompt": "x"}) > 0      # a producer using the budget always admits > 0


def test_a_counter_that_is_no_integer_never_fails_a_write(r, keys):
    enqueue_costed(r, keys, "j", 9)
    r.delete(keys.budget())
    r.hset(keys.budget(), "x", "1")                      # overwritten by hand, wrong type
    r.set(keys.owner("j"), "w1:a")
    done = encode_event(DoneEvent(finish_reason="stop"))
    assert write(r, keys, "j", "b.0", [b"t0", done], 9) is WriteStatus.OK
    assert len(r.xrange(keys.results("j"))) == 2
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    r.delete(keys.results("j"))
    assert dead_letter(r, keys, "b", entry) == "written"


def test_a_user_without_decrby_gets_noperm_not_a_budget_that_never_empties(r, keys):
    import redis as redis_lib
    from tokenrelay.worker.connection import ErrorKind, classify, classify_text
    enqueue_costed(r, keys, "j", 9)
    r.set(keys.owner("j"), "w1:a")
    r.acl_setuser("old-rules", enabled=True, passwords=["+pw"], keys=["*"],
                  commands=["+@all", "-decrby"])
    kw = r.connection_pool.connection_kwargs
    old = redis_lib.Redis(host=kw["host"], port=kw["port"], username="old-rules", password="pw")
    try:
        pipe = ScriptPipeline(old)
        done = encode_event(DoneEvent(finish_reason="stop"))
        Fence(keys).write_step(pipe, 60_000, 0, [("j", "w1:a", "b.0", [done], True, 0, True)],
                               [9])
        ((status, _, why),) = parse_step_reply(pipe.execute()[0])
        assert status is WriteStatus.ERROR and classify_text(why) is ErrorKind.PERMANENT
        enqueue_costed(r, keys, "p", 4)
        read_as(r, keys, "b")
        entry = next(e for e in keeper(r, keys, "b").read_own_pending() if e.cost == 4)
        with pytest.raises(redis_lib.ResponseError) as err:
            dead_letter(old, keys, "b", entry)
        assert classify(err.value) is ErrorKind.PERMANENT
    finally:
        old.close()
