"""worker/admission.py against a real redis-server (issue #13): any failure admitting one job
ends that job alone; dead letters are bounded and carry the job id; a job id is bound to one
entry (a second entry reusing it cannot hijack the job); a transient Redis error on the start
pipeline puts the batch back untouched (``StartDeferred``) and the loop takes it again, as it
is, after its backoff."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import redis

from tokenrelay.protocol.keys import GROUP, Keys, dedupe_record
from tokenrelay.protocol.wire import DeadLetter
from tests.fault_harness import check_stream, read_events, submit, wait_for, wait_for_terminal
from tests.worker.hand_driven import hand_worker, iterate_until  # noqa: F401
from tokenrelay.worker.admission import StartDeferred
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

pytestmark = pytest.mark.timeout(60)
KEYS = Keys()


@pytest.fixture
def r(redis_server):
    client = redis_server.client()
    yield client
    client.close()


def raw_job(job_id: str, prompt: Any = "hello", **fields: Any) -> bytes:
    return msgpack.packb({"v": 1, "job_id": job_id, "prompt": prompt,
                          "params": {"max_tokens": 4, "temperature": 0}, **fields})


def only_terminal(events: list) -> Any:
    ends = [e for e in events if e.type in ("done", "error")]
    assert len(ends) == 1 and events[-1] is ends[0], events
    return ends[0]


def letters(r) -> list[DeadLetter]:
    return [DeadLetter.from_fields(f) for _, f in r.xrange(KEYS.dead())]


def lanes_settled(r) -> bool:
    return all(r.xpending(k, GROUP)["pending"] == 0 for k in KEYS.lanes())


class FragileEngine(FakeEngine):
    """Refuses some requests the way a broken engine or template would: with exceptions the
    worker was never told about."""

    def add_request(self, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(prompt, str) and "explode" in prompt:
            raise RuntimeError("kaboom in add_request")
        super().add_request(request_id, prompt, *args, **kwargs)

    def render_chat(self, messages: list[dict], *args: Any) -> str:
        if any("bad template" in m.get("content", "") for m in messages):
            raise KeyError("the chat template has no 'tool' role")
        return super().render_chat(messages, *args)


def test_any_admission_failure_ends_that_job_alone(start_worker, r):
    """Finding 1: "stop": 5 used to raise TypeError out of the validator and kill the worker;
    an engine raising anything on add_request or in its chat template ends that job alone."""
    w = start_worker(engine=FragileEngine())
    batch = {
        "stop-int": raw_job("stop-int", params={"stop": 5, "max_tokens": 4}),
        "stream-str": raw_job("stream-str", stream="yes"),
        "tokens-str": raw_job("tokens-str", params={"max_tokens": "5"}),
        "explode": raw_job("explode", "please explode"),
        "template": msgpack.packb({"v": 1, "job_id": "template", "messages": [
            {"role": "user", "content": "bad template"}], "params": {"max_tokens": 3}}),
        "good-1": raw_job("good-1", "fine one"),
        "good-2": raw_job("good-2", "fine two"),
    }
    for raw in batch.values():
        submit(r, KEYS, None, raw=raw)
    out = wait_for_terminal(r, KEYS, list(batch), 20)
    codes = {j: (only_terminal(ev).type, getattr(only_terminal(ev), "code", None))
             for j, ev in out.items()}
    assert codes["stop-int"] == ("error", "invalid_request")
    assert "params.stop" in only_terminal(out["stop-int"]).message
    assert "stream" in only_terminal(out["stream-str"]).message
    assert "max_tokens" in only_terminal(out["tokens-str"]).message
    assert codes["explode"] == ("error", "internal")
    assert "kaboom" in only_terminal(out["explode"]).message
    assert codes["template"][0] == "error"
    for good, prompt in (("good-1", "fine one"), ("good-2", "fine two")):
        text = "".join(e.text for e in out[good] if e.type == "token")
        assert text == fake_completion(prompt, 4)
    assert w.thread.is_alive() and not w.result
    wait_for(lambda: lanes_settled(r), 10, what="every entry acknowledged")
    dead = {d.job_id: d for d in letters(r)}
    assert {"stop-int", "stream-str", "tokens-str"} <= set(dead)


def test_an_invalid_jobs_error_event_echoes_only_metadata_a_valid_job_could_carry(
        start_worker, r):
    """Found by tests/faults/test_fuzz.py: an invalid job whose metadata had an integer key made
    building its error event raise, so the rejection never landed. Valid metadata is echoed (for
    correlation); integer keys, too deep or too big metadata are dropped from the event."""
    w = start_worker()
    cases = {
        "meta-ok": {"trace": "abc", "n": [1, {"x": 2}]},
        "meta-int-key": {1: "one", "fine": "two"},
        "meta-deep": _deep_map(200),
        "meta-huge": {"pad": "x" * 70_000},
    }
    for job_id, meta in cases.items():
        submit(r, KEYS, None, raw=raw_job(job_id, 12345, metadata=meta))  # prompt: wrong type
    out = wait_for_terminal(r, KEYS, list(cases), 20)
    ends = {j: only_terminal(ev) for j, ev in out.items()}
    assert all(e.type == "error" and e.code == "invalid_request" for e in ends.values()), ends
    assert ends["meta-ok"].metadata == cases["meta-ok"]
    for job_id in ("meta-int-key", "meta-deep", "meta-huge"):
        assert ends[job_id].metadata == {}, job_id
    assert w.thread.is_alive() and not w.result
    wait_for(lambda: lanes_settled(r), 10, what="every entry acknowledged")


def _deep_map(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"k": value}
    return value


def test_dead_letters_are_truncated_capped_and_carry_the_job_id(start_worker, r):
    """Finding 3: the invalid-payload path kept whole payloads in an uncapped stream."""
    r.config_set("stream-node-max-entries", 10)   # lets MAXLEN ~ trim close to the cap
    start_worker(dead_letter_maxlen=20, dead_letter_payload_bytes=100)
    pad = "x" * 5000
    ids = [f"bad-{i}" for i in range(60)]
    for jid in ids:
        submit(r, KEYS, None, raw=raw_job(jid, 12345, metadata={"pad": pad}))
    out = wait_for_terminal(r, KEYS, ids, 30)
    assert all(only_terminal(ev).code == "invalid_request" for ev in out.values())
    wait_for(lambda: lanes_settled(r), 10, what="every entry acknowledged")
    kept = letters(r)
    assert 0 < len(kept) <= 20 + 10
    for d in kept:
        assert d.job_id.startswith("bad-") and d.code == "invalid_request"
        assert len(d.data) == 100 and d.truncated and d.size > 5000


def test_a_second_entry_reusing_a_live_job_id_is_rejected(start_worker, r):
    """Finding 4: a raw XADD reusing a running job's id was taken over by a second worker:
    the victim's stream continued on the attacker's prompt and metadata."""
    start_worker(engine=FakeEngine(step_delay=0.02), worker_id="w1")
    victim_entry = submit(r, KEYS, None, raw=raw_job("victim", "victim prompt",
                                                     params={"max_tokens": 150, "temperature": 0},
                                                     metadata={"owner": "alice"}))
    wait_for(lambda: len(read_events(r, KEYS, "victim")) > 2, 10, what="victim running")
    # The second worker starts once w1 runs the victim (started before, it could take the
    # victim itself): the duplicate then meets a live job whichever worker reads it.
    start_worker(worker_id="w2")
    attacker = submit(r, KEYS, None, raw=raw_job("victim", "attacker prompt",
                                                 metadata={"owner": "mallory"}))
    assert not any(e.type == "done" for e in read_events(r, KEYS, "victim"))   # still live
    events = wait_for_terminal(r, KEYS, "victim", 20)["victim"]
    done = only_terminal(events)
    assert done.type == "done" and done.metadata == {"owner": "alice"}
    assert "".join(e.text for e in events if e.type == "token") == \
        fake_completion("victim prompt", 150)
    assert [e.worker_id for e in events if e.type == "started"] == ["w1"]
    wait_for(lambda: letters(r), 10, what="the duplicate dead-lettered")
    (dead,) = letters(r)
    assert (dead.job_id, dead.code, dead.entry_id) == ("victim", "duplicate_job_id", attacker)
    assert r.get(KEYS.dedupe("victim")).decode() == dedupe_record(KEYS.lane("default"),
                                                                  victim_entry)
    wait_for(lambda: lanes_settled(r), 10, what="both entries acknowledged")


def test_a_transient_error_defers_the_whole_batch_untouched(hand_worker, r):
    w = hand_worker()
    greedy = {"max_tokens": 3, "temperature": 0}
    ids = [submit(r, KEYS, {"job_id": f"d{i}", "prompt": f"d{i}", "params": greedy})
           for i in range(3)]
    c = w._crew()
    entries = c.intake.collect(block=False)
    assert [e.entry_id for e in entries] == ids
    r.config_set("maxmemory", 1)                   # the start pipeline's writes: OOM
    try:
        with pytest.raises(StartDeferred) as deferred:
            c.admission.admit(entries, set(w.held_entries()))
        assert deferred.value.entries == entries and "maxmemory" in str(deferred.value.cause)
        assert not w.jobs and not r.keys(KEYS.dedupe("*")) and not r.keys(KEYS.owner("*"))
        with pytest.raises(redis.ResponseError, match="maxmemory"):   # the loop re-raises
            w._admit(entries)
        assert c.intake.deferred == entries
    finally:
        r.config_set("maxmemory", 0)
    again = c.intake.collect(block=False)           # taken as they are: no re-read
    assert again == entries and c.intake.deferred == []
    assert all(row["times_delivered"] == 1
               for row in r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10))
    w._admit(again)
    iterate_until(w, lambda: all(check_stream(r, KEYS, f"d{i}").ended for i in range(3)))
    assert all(check_stream(r, KEYS, f"d{i}").text == fake_completion(f"d{i}", 3)
               for i in range(3))
