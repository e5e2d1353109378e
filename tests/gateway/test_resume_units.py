"""Resumable streams, piece by piece: event ids (parse, stamp, skip), and the four scripts that
decide who holds a stream, on a real redis-server (the scripts need Lua): a resume and the
grace's end each have one atomic outcome."""

from __future__ import annotations

import json

import pytest
import redis

from tokenrelay.producer_sdk.gateway.errors import APIError
from tokenrelay.producer_sdk.gateway.resume import (EventId, Marks, StreamSpec, body_digest,
                                                    owner_digest, parse_event_id, render_body)
from tokenrelay.producer_sdk.openai.format import CHAT_URL, COMPLETIONS_URL, parse_request
from tokenrelay.protocol.keys import stream_session_key
from tokenrelay.protocol.scripts import (CLAIM_STREAM, END_STREAM, EXPIRE_PARKED, PARK_STREAM,
                                         run_script)

pytestmark = pytest.mark.timeout(60)
JOB = "gw-" + "ab" * 16


@pytest.mark.parametrize("raw", ["", "x", f"{JOB}:1", f"{JOB}:1:2:3", f"{JOB}:-1:0",
                                 f"{JOB}:1:x", "gw-123:1:0", f"{JOB.upper()}:1:0",
                                 f"{JOB}:1234567890:0", f"job{{x}}:1:0"])
def test_event_ids_other_than_the_gateways_are_400_naming_the_header(raw):
    with pytest.raises(APIError) as err:
        parse_event_id(raw)
    assert err.value.status == 400 and err.value.param == "Last-Event-ID"
    assert err.value.code == "invalid_last_event_id"


def test_an_event_id_round_trips():
    assert parse_event_id(f" {JOB}:12:3 ") == EventId(JOB, 12, 3)
    assert EventId(JOB, 12, 3).text() == f"{JOB}:12:3"


def stamped(marks: Marks, plan: list[tuple[int, int]]) -> list:
    """Render ``plan`` (a delta's seq, its event count; seq -1: the ending's events)."""
    out = []
    for seq, count in plan:
        if seq >= 0:
            marks.delta(seq)
        out += [marks.stamp() for _ in range(count)]
    return out


PLAN = [(0, 2), (1, 1), (2, 0), (3, 2), (-1, 3)]


def test_marks_number_events_by_token_count_and_rank():
    assert stamped(Marks(JOB), PLAN) == [
        f"{JOB}:1:0", f"{JOB}:1:1", f"{JOB}:2:0", f"{JOB}:4:0", f"{JOB}:4:1", f"{JOB}:4:2",
        f"{JOB}:4:3", f"{JOB}:4:4"]


@pytest.mark.parametrize("cut", range(8))
def test_marks_after_an_id_send_exactly_the_events_after_it(cut):
    whole = stamped(Marks(JOB), PLAN)
    marks = Marks(JOB, parse_event_id(whole[cut]))
    again = stamped(marks, PLAN)
    assert again[:cut + 1] == [None] * (cut + 1) and again[cut + 1:] == whole[cut + 1:]
    assert marks.reached and marks.last == whole[-1]


def test_marks_refuse_an_id_the_stream_never_had_and_a_gap_before_it():
    with pytest.raises(APIError) as err:
        stamped(Marks(JOB, EventId(JOB, 2, 1)), PLAN)       # delta 1 rendered one event
    assert err.value.status == 400
    with pytest.raises(APIError) as err:
        stamped(Marks(JOB, EventId(JOB, 4, 1)), [(0, 1), (2, 1)])   # token event 1 is gone
    assert err.value.status == 410 and err.value.code == "stream_gone"
    marks = Marks(JOB, EventId(JOB, 1, 0))
    assert stamped(marks, [(0, 1), (2, 1)]) == [None, f"{JOB}:3:0"]   # past the point: live


def test_the_render_body_keeps_the_answers_shape_and_drops_the_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}],
            "stream": True, "logprobs": True, "top_logprobs": 3, "n": 2,
            "stream_options": {"include_usage": True}, "metadata": {"a": "b"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    slim = render_body(CHAT_URL, body)
    assert len(json.dumps(slim)) < 400
    a, b = parse_request(CHAT_URL, body, streaming=True), parse_request(CHAT_URL, slim,
                                                                          streaming=True)
    assert (a.chat, a.logprobs, a.include_usage, a.n, a.model, a.kwargs["logprobs"]) == \
        (b.chat, b.logprobs, b.include_usage, b.n, b.model, b.kwargs["logprobs"])
    assert a.tools == b.tools
    assert render_body(COMPLETIONS_URL, {"prompt": [1, 2], "model": "m"}) == \
        {"model": "m", "prompt": "-"}
    assert body_digest({"a": 1, "b": 2}) == body_digest({"b": 2, "a": 1})
    assert owner_digest(None) == "-" and "key" not in owner_digest("key")


SPEC = StreamSpec(url=COMPLETIONS_URL, body={"model": "m", "prompt": "-"}, created=1,
                  model="m", queue="q", shards=1, shard=0).model_dump_json()


@pytest.fixture
def r(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def record(r, state: str = "live", token: str = "t1") -> str:
    key = stream_session_key("ns", JOB)
    r.hset(key, mapping={"owner": "o", "digest": "d", "state": state, "token": token,
                         "spec": SPEC})
    return key


def call(r, script, key, *args):
    reply = run_script(r, script, [key], list(args))
    return [x.decode() if isinstance(x, bytes) else x for x in reply] \
        if isinstance(reply, list) else reply


def test_claim_takes_a_live_or_parked_stream_and_refuses_others(r):
    key = record(r)
    assert call(r, CLAIM_STREAM, key, "x", "t2", "") == ["forbidden"]
    assert call(r, CLAIM_STREAM, key, "o", "t2", "other") == ["mismatch"]
    assert r.hget(key, "token") == b"t1"                    # refused: nothing changed
    assert call(r, CLAIM_STREAM, key, "o", "t2", "d") == ["claimed", "live", SPEC]
    assert r.hget(key, "token") == b"t2"
    assert call(r, PARK_STREAM, key, "t1", 5000, 60000) == 0        # t1 no longer holds it
    assert call(r, PARK_STREAM, key, "t2", 5000, 60000) > 0
    assert call(r, EXPIRE_PARKED, key)[0] == "wait"
    assert call(r, CLAIM_STREAM, key, "o", "t3", "") == ["claimed", "parked", SPEC]
    assert call(r, EXPIRE_PARKED, key) == ["skip"]           # resumed: the sweep lets it be
    assert call(r, CLAIM_STREAM, stream_session_key("ns", "gw-none"), "o", "t", "") == \
        ["missing"]


def test_a_grace_that_ran_out_cancels_once_whoever_comes_first(r):
    key = record(r)
    call(r, PARK_STREAM, key, "t1", 0, 60000)
    assert call(r, CLAIM_STREAM, key, "o", "t2", "") == ["expired", SPEC]   # the resume: 410
    assert call(r, EXPIRE_PARKED, key) == ["skip"]           # and the sweep does not again
    assert call(r, CLAIM_STREAM, key, "o", "t3", "") == ["cancelled"]
    key = record(r)
    call(r, PARK_STREAM, key, "t1", 0, 60000)
    assert call(r, EXPIRE_PARKED, key) == ["cancel", SPEC]   # the sweep first
    assert call(r, CLAIM_STREAM, key, "o", "t2", "") == ["cancelled"]
    assert call(r, END_STREAM, key, 60000) == 0              # cancelled stays cancelled


def test_an_ended_stream_is_never_parked_and_end_creates_no_record(r):
    key = record(r)
    assert call(r, END_STREAM, key, 60000) == 1
    assert 0 < r.pttl(key) <= 60000                          # resumable the TTL from its end
    assert call(r, CLAIM_STREAM, key, "o", "t2", "") == ["claimed", "ended", SPEC]
    assert r.hget(key, "state") == b"ended"
    assert call(r, PARK_STREAM, key, "t2", 5000, 60000) == 0
    missing = stream_session_key("ns", "gw-gone")
    assert call(r, END_STREAM, missing, 60000) == 0 and not r.exists(missing)
    assert call(r, PARK_STREAM, missing, "t", 5000, 60000) == -1 and not r.exists(missing)


def test_a_parked_record_outlives_its_grace(r):
    key = record(r)
    r.pexpire(key, 1000)
    assert call(r, PARK_STREAM, key, "t1", 5000, 60000) > 0
    assert r.pttl(key) > 5000
