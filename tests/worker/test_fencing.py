"""Result-stream fencing (worker/fencing.py) and identity binding, through their scripts
(protocol/scripts/results.py), against a real redis-server. The pending-list scripts are
tested in tests/worker/test_pending.py."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import GROUP, Keys, dedupe_record
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.fencing import Fence, WriteStatus, bound, entry_lost, parse_step_reply

K = Keys()
LANE = K.lane("default")


@pytest.fixture
def r(redis_server):
    c = redis_server.client()
    c.xgroup_create(LANE, GROUP, id="0", mkstream=True)
    yield c
    c.close()


def run(r, build):
    pipe = ScriptPipeline(r)
    build(pipe)
    return pipe.execute()


def write(r, fence, owner, batch, events, create=True, ttl=60_000, job="j", known=0):
    (res,) = run(r, lambda p: fence.write_step(p, ttl, 0, [(job, owner, batch, events, create,
                                                          known, True)]))
    return parse_step_reply(res)[0][0]


def own(r, fence, job, owner, entry_id="1-1"):
    """Bind and own ``job`` for the lane entry ``entry_id`` (added to the lane if missing: the
    script refuses an entry its lane does not hold)."""
    if not r.xrange(LANE, entry_id, entry_id):
        r.xadd(LANE, {"p": b"x"}, id=entry_id)
    (res,) = run(r, lambda p: fence.bind_and_own(p, job, 0, LANE, entry_id, owner, 60_000))
    return bound(res)


def test_write_requires_ownership_and_sets_ttl(r):
    f = Fence(K)
    assert write(r, f, "w1:a", "a.0", [b"e1"]) is WriteStatus.MISSING
    assert own(r, f, "j", "w1:a")
    assert write(r, f, "w1:a", "a.0", [b"e1", b"e2"]) is WriteStatus.OK
    assert 0 < r.pttl(K.results("j")) <= 60_000
    assert own(r, f, "j", "w2:b")  # takeover of the same entry
    assert write(r, f, "w1:a", "a.1", [b"late"], create=False) is WriteStatus.REFUSED
    assert [x[1][b"data"] for x in r.xrange(K.results("j"))] == [b"e1", b"e2"]


def test_retried_batch_is_idempotent_and_completes_a_partial_one(r):
    f = Fence(K)
    own(r, f, "j", "w1:a")
    assert write(r, f, "w1:a", "a.0", [b"s", b"t0"]) is WriteStatus.OK
    assert write(r, f, "w1:a", "a.0", [b"s", b"t0"], known=0) is WriteStatus.DUP
    # a batch that died half way: only its first event landed
    r.xadd(K.results("j"), {"data": b"t1", "b": b"a.1:1"})
    assert write(r, f, "w1:a", "a.1", [b"t1", b"t2", b"done"], create=False,
                 known=2) is WriteStatus.OK
    assert [x[1][b"data"] for x in r.xrange(K.results("j"))] == [b"s", b"t0", b"t1", b"t2",
                                                                  b"done"]
    # more entries than the writer knows, and not of the batch it retries: never guessed at
    assert write(r, f, "w1:a", "a.2", [b"x"], create=False, known=2) is WriteStatus.BEHIND
    assert write(r, f, "w1:a", "a.1", [b"t1", b"t2", b"done"], create=False,
                 known=3) is WriteStatus.BEHIND                 # 2 more landed, the mark says 3
    assert r.xlen(K.results("j")) == 5


def test_expired_stream_is_never_recreated(r):
    f = Fence(K)
    own(r, f, "j", "w1:a")
    assert write(r, f, "w1:a", "a.0", [b"s"]) is WriteStatus.OK
    r.delete(K.results("j"))  # expired
    assert write(r, f, "w1:a", "a.1", [b"t"], create=False, known=1) is WriteStatus.GONE
    # a writer whose first write's reply was lost still says create, but knows it landed
    assert write(r, f, "w1:a", "a.1", [b"t"], known=1) is WriteStatus.GONE
    assert not r.exists(K.results("j"))
    r.delete(K.owner("j"))
    assert write(r, f, "w1:a", "a.1", [b"t"], create=False, known=1) is WriteStatus.MISSING
    assert write(r, f, "w1:a", "a.0", [b"s"]) is WriteStatus.MISSING
    assert not r.exists(K.results("j"))


def test_identity_binds_a_job_id_to_one_entry(r):
    f = Fence(K)
    assert own(r, f, "j", "w1:a", entry_id="5-1")                # absent: bound to 5-1
    assert r.get(K.dedupe("j")).decode() == dedupe_record(LANE, "5-1")
    assert 0 < r.ttl(K.dedupe("j")) <= 86_400
    assert not own(r, f, "j", "w2:b", entry_id="6-1")            # another entry: refused
    assert r.get(K.owner("j")) == b"w1:a"                        # nothing of j touched
    assert own(r, f, "j", "w3:c", entry_id="5-1")                # the bound entry: taken over
    assert r.get(K.owner("j")) == b"w3:c"


def test_write_step_isolates_jobs_and_reads_cancel_flags(r):
    f = Fence(K)
    for j in ("a", "b", "c"):
        own(r, f, j, f"w1:{j}")
    r.set(K.results("b"), "not a stream")          # a broken key must not fail a or c
    r.set(K.cancel("c"), 1)
    (reply,) = run(r, lambda p: f.write_step(p, 60_000, 0, [
        ("a", "w1:a", "a.0", [b"a1", b"a2"], True, 0, False),
        ("b", "w1:b", "b.0", [b"b1"], True, 0, False),
        ("c", "w1:c", "c.0", [], True, 0, False),
        ("d", "w1:d", "d.0", [b"d1"], True, 0, False)]))   # no owner record
    got = [(st, cancel) for st, cancel, _ in parse_step_reply(reply)]
    assert got == [(WriteStatus.OK, False), (WriteStatus.ERROR, False),
                   (WriteStatus.SKIP, True), (WriteStatus.MISSING, False)]
    assert "WRONGTYPE" in parse_step_reply(reply)[1][2]
    assert [x[1][b"data"] for x in r.xrange(K.results("a"))] == [b"a1", b"a2"]
    # a retry of a's batch after a lost reply (known: what was there before) adds nothing;
    # without create the expired stream of another job is not recreated
    r.delete(K.results("c"))
    (reply,) = run(r, lambda p: f.write_step(p, 60_000, 0, [
        ("a", "w1:a", "a.0", [b"a1", b"a2"], False, 0, False),
        ("c", "w1:c", "c.1", [b"c1"], False, 0, False)]))
    assert [st for st, _, _ in parse_step_reply(reply)] == [WriteStatus.DUP, WriteStatus.GONE]
    assert r.xlen(K.results("a")) == 2 and not r.exists(K.results("c"))
    assert not r.exists(K.results("c")) and not r.exists(K.results("d"))


def test_every_write_finds_events_a_failover_or_restart_lost_and_writes_nothing(r):
    """A replica promoted after its master died, or a Redis restarted from an AOF that lost its
    last second, may lack the last events the worker saw acknowledged, and the worker may have
    seen no error at all (its client reconnects silently). Every write names how many entries
    the worker knows the stream holds; a shorter stream is BEHIND and gets nothing
    appended, so no reader ever sees a gap (the worker resumes the job from what survived). A
    lost owner record with the stream still there is BEHIND too; a whole stream lost is GONE
    (never recreated: a fresh start would draw a new seed beside what readers hold)."""
    f = Fence(K)
    own(r, f, "j", "w1:a")
    assert write(r, f, "w1:a", "a.0", [b"s", b"t0"]) is WriteStatus.OK
    assert write(r, f, "w1:a", "a.1", [b"t1"], create=False, known=2) is WriteStatus.OK
    lost = r.xrevrange(K.results("j"), count=1)[0][0]
    r.xdel(K.results("j"), lost)                          # the restart lost a.1
    assert write(r, f, "w1:a", "a.2", [b"t2"], create=False, known=3) is WriteStatus.BEHIND
    assert [x[1][b"data"] for x in r.xrange(K.results("j"))] == [b"s", b"t0"]
    # nothing lost: the same write goes through
    assert write(r, f, "w1:a", "a.1", [b"t1"], create=False, known=2) is WriteStatus.OK
    assert write(r, f, "w1:a", "a.2", [b"t2"], create=False, known=3) is WriteStatus.OK
    # the owner record lost, the stream kept: resume (admission takes ownership again)
    r.delete(K.owner("j"))
    assert write(r, f, "w1:a", "a.3", [b"t3"], create=False, known=4) is WriteStatus.BEHIND
    assert r.xlen(K.results("j")) == 4 and not r.exists(K.owner("j"))
    # a whole stream lost (created on the old master only, or in the lost second)
    own(r, f, "j", "w1:a")
    r.delete(K.results("j"))
    assert write(r, f, "w1:a", "a.3", [b"t3"], create=False, known=4) is WriteStatus.GONE
    r.delete(K.owner("j"))
    assert write(r, f, "w1:a", "a.3", [b"t3"], create=False, known=4) is WriteStatus.MISSING
    assert not r.exists(K.results("j")) and not r.exists(K.owner("j"))


def test_an_entry_redis_lost_is_neither_bound_nor_owned(r):
    """A Redis that came back without its data no longer holds an entry the worker had read:
    binding it would recreate the job's dedupe record and owner beside the rerun its readers
    enqueue, so the script touches nothing and says 'lost'."""
    f = Fence(K)
    (res,) = run(r, lambda p: f.bind_and_own(p, "j", 0, LANE, "7-1", "w1:a", 60_000))
    assert entry_lost(res) and not bound(res)
    assert not r.exists(K.dedupe("j")) and not r.exists(K.owner("j"))
    assert own(r, f, "j", "w1:a", entry_id="7-1")      # the same entry once the lane holds it


def test_write_step_sets_ttls_on_create_and_refresh_only(r):
    """Step writes leave the TTLs alone unless the stream is created or the worker asks for a
    refresh; whichever way, a result stream never exists without a TTL."""
    f = Fence(K)
    own(r, f, "a", "w1:a")
    r.pexpire(K.owner("a"), 60_000)
    run(r, lambda p: f.write_step(p, 60_000, 0, [("a", "w1:a", "a.0", [b"a1"], True, 0, False)]))
    assert 0 < r.pttl(K.results("a")) <= 60_000
    r.pexpire(K.results("a"), 5_000)
    r.pexpire(K.owner("a"), 5_000)
    run(r, lambda p: f.write_step(p, 60_000, 0, [("a", "w1:a", "a.1", [b"a2"], False, 1,
                                                  False)]))
    assert r.pttl(K.results("a")) <= 5_000 and r.pttl(K.owner("a")) <= 5_000
    run(r, lambda p: f.write_step(p, 60_000, 0, [("a", "w1:a", "a.2", [b"a3"], False, 2,
                                                  True)]))
    assert r.pttl(K.results("a")) > 5_000 and r.pttl(K.owner("a")) > 5_000
    assert r.xlen(K.results("a")) == 3


def test_scripts_survive_a_script_cache_flush(r):
    f = Fence(K)
    own(r, f, "j", "w1:a")
    r.script_flush()
    assert write(r, f, "w1:a", "a.0", [b"x"]) is WriteStatus.OK


def test_step_keys_are_the_keys_of_the_job_and_bounded(monkeypatch):
    import tokenrelay.worker.fencing as fencing
    keys = Keys(namespace="t-stepkeys", shards=4)
    f = Fence(keys)
    assert f.step_keys("job-1", 2) == (keys.owner("job-1", 2).encode(),
                                       keys.results("job-1", 2).encode(),
                                       keys.cancel("job-1", 2).encode())
    assert f.step_keys("job-1", 3)[0] == keys.owner("job-1", 3).encode()   # its shard's key
    monkeypatch.setattr(fencing, "STEP_KEYS_MEMO", 2)
    for i in range(5):
        assert f.step_keys(f"j{i}", 0)[1] == keys.results(f"j{i}", 0).encode()
    assert len(f._step_keys) <= 2
