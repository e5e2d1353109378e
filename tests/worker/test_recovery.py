"""worker/recovery.py: what a job's result stream says its client already has, read the way
admission reads it (one raw XRANGE in its start pipeline, ``stream_entries``) and folded with
the protocol's ``ResultFold``."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.events import DoneEvent, StartedEvent, TokenEvent, encode_event
from tokenrelay.protocol.keys import BATCH_FIELD, EVENT_FIELD, Keys
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.admission import stream_entries
from tokenrelay.worker.recovery import JobProgress, progress_from_entries

pytestmark = pytest.mark.timeout(60)
KEY = Keys().results("j")


def progress(r) -> JobProgress:
    """As admission reads a job's stream: XRANGE - + in a ScriptPipeline (raw reply)."""
    pipe = ScriptPipeline(r)
    i = pipe.command("XRANGE", KEY, "-", "+")
    return progress_from_entries(stream_entries(pipe.execute()[i]))


def add(r, *events, mark: bytes = b"x:1") -> None:
    for e in events:
        r.xadd(KEY, {EVENT_FIELD: encode_event(e), BATCH_FIELD: mark})


def test_a_partial_stream_resumes_after_its_last_token(redis_server):
    r = redis_server.client()
    add(r, StartedEvent(worker_id="a", seed=11),
        TokenEvent(seq=0, position=0, text="he", token_ids=[1, 2]),
        TokenEvent(seq=1, position=2, text="llo", token_ids=[3]),
        StartedEvent(worker_id="b", attempt=2, seed=11, resumed_tokens=3))
    add(r, TokenEvent(seq=2, position=3, text="!", token_ids=[4]), mark=b"b.4:1")
    p = progress(r)
    assert (p.exists, p.attempts, p.seed, p.next_seq, p.last_seq) == (True, 2, 11, 3, 2)
    assert p.token_ids == [1, 2, 3, 4] and p.text == "hello!" and not p.finished
    assert p.entries == 5                  # what every write of the resumed job checks (XLEN)


def test_terminal_duplicates_and_garbage(redis_server):
    r = redis_server.client()
    add(r, StartedEvent(worker_id="a", seed=1),
        TokenEvent(seq=0, position=0, text="a", token_ids=[1]),
        TokenEvent(seq=0, position=0, text="a", token_ids=[1]),   # duplicate: skipped
        DoneEvent(finish_reason="length"))
    r.xadd(KEY, {EVENT_FIELD: b"\xc1"})                            # not an event: counted
    p = progress(r)
    assert p.token_ids == [1] and p.text == "a" and p.finished and p.undecodable == 1
    assert p.terminal.type == "done" and p.entries == 5           # the garbage counts too


def test_no_stream_is_a_fresh_job(redis_server):
    p = progress(redis_server.client())
    assert p.exists is False and p.attempts == 0 and p.next_seq == 0 and p.entries == 0
