"""Protocol v1 unit tests: keys, payload validation, events, dead letters, resume-read, settings.

Fast: no redis-server (fakeredis where a client is needed; it has no Lua, so the fenced scripts
are tested against a real server in tests/worker/test_fencing.py).
"""

from __future__ import annotations

import subprocess
import sys

import fakeredis
import msgpack
import pytest

from producer_sdk.protocol import (BATCH_FIELD, EVENT_FIELD, GROUP, PARKING_CONSUMER,
                                   PROTOCOL_VERSION, DeadLetter, DoneEvent, ErrorCode, ErrorEvent,
                                   JobRequest, Keys, ProtocolError, StartedEvent, TokenEvent,
                                   decode_event, decode_job, encode_event, encode_job, is_terminal)
from worker.config import WorkerSettings, build_parser, parse_size, settings_from_args
from worker.health import check_health
from worker.intake import Entry
from worker.jobs import Job
from worker.recovery import progress_from_entries, read_progress
from worker.testing import FakeDelta


# ------------------------------------------------------------------------------------------
# keys
# ------------------------------------------------------------------------------------------

def test_keys_layout_and_hash_tags():
    k = Keys("ns", "q")
    assert k.lanes() == ["ns:jobs:q:urgent", "ns:jobs:q", "ns:jobs:q:bulk"]
    assert k.jobs_stream(-5) == "ns:jobs:q:urgent" and k.jobs_stream(0) == "ns:jobs:q"
    assert k.jobs_stream(3) == "ns:jobs:q:bulk"
    assert k.dead == "ns:dead:q" and k.workers == "ns:workers:q"
    assert k.heartbeat("w1") == "ns:worker:w1"
    for key in (k.results("j"), k.cancel("j"), k.owner("j"), k.dedupe("j")):
        assert "{j}" in key  # same Redis Cluster slot for one job's keys
    with pytest.raises(ValueError):
        Keys("bad:ns")
    with pytest.raises(ValueError):
        k.lane("nope")


def test_parking_consumer_is_not_a_valid_worker_id():
    with pytest.raises(ValueError):
        WorkerSettings(worker_id=PARKING_CONSUMER)


# ------------------------------------------------------------------------------------------
# job payloads
# ------------------------------------------------------------------------------------------

def test_job_roundtrip():
    job = JobRequest(job_id="a1", prompt="hi", params={"max_tokens": 3}, priority=-1,
                     metadata={"x": [1, 2]}, deadline_ms=5, stream=False)
    back = decode_job(encode_job(job))
    assert back == job and back.v == PROTOCOL_VERSION


@pytest.mark.parametrize("raw, fragment, job_id", [
    (b"\xc1\xc1", "not msgpack", None),
    (msgpack.packb([1, 2]), "must be a msgpack map", None),
    (msgpack.packb({"v": 2, "job_id": "j", "prompt": "x"}), "v=2", "j"),
    (msgpack.packb({"v": 1, "job_id": "j"}), "exactly one of", "j"),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": "x", "messages": []}), "exactly one", "j"),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": 3}), "prompt", "j"),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": "x", "typo": 1}), "typo", "j"),
    (msgpack.packb({"v": 1, "job_id": "a b", "prompt": "x"}), "job_id", None),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt_token_ids": [-1]}), "non-negative", "j"),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": "x", "priority": 2**40}), "priority", "j"),
])
def test_decode_job_rejects_bad_payloads(raw, fragment, job_id):
    with pytest.raises(ProtocolError) as exc:
        decode_job(raw)
    assert fragment in str(exc.value)
    assert exc.value.job_id == job_id
    assert exc.value.code is ErrorCode.INVALID_REQUEST


def test_sampling_params_errors_name_the_field():
    job = JobRequest(job_id="j", prompt="x", params={"temperature": -1})
    with pytest.raises(Exception) as exc:
        job.sampling_params()
    assert "temperature" in str(exc.value)


# ------------------------------------------------------------------------------------------
# events
# ------------------------------------------------------------------------------------------

def test_events_roundtrip_and_terminal():
    evs = [StartedEvent(worker_id="w", seed=7), TokenEvent(seq=0, index=0, text="a", token_ids=[1],
                                                           logprobs=[{1: -0.1}]),
           DoneEvent(finish_reason="stop", metadata={"m": 1}),
           ErrorEvent(code="expired", message="late")]
    back = [decode_event(encode_event(e)) for e in evs]
    assert [b.type for b in back] == ["started", "token", "done", "error"]
    assert back[1].logprobs == [{1: -0.1}]
    assert [is_terminal(b) for b in back] == [False, False, True, True]
    with pytest.raises(ProtocolError):
        decode_event(msgpack.packb({"type": "bogus"}))


def test_dead_letter_fields_keep_raw_payload():
    raw = b"\x00\xff not even utf-8"
    dl = DeadLetter(data=raw, reason="r", code="invalid_request", worker_id="w", lane="l",
                    entry_id="1-0", deliveries=3)
    r = fakeredis.FakeRedis()
    r.xadd("dead", dl.to_fields())
    (_, fields), = r.xrange("dead")
    back = DeadLetter.from_fields(fields)
    assert back.data == raw and back.deliveries == 3 and back.entry_id == "1-0"


# ------------------------------------------------------------------------------------------
# job bookkeeping -> events
# ------------------------------------------------------------------------------------------

def _job(**kw) -> Job:
    req = JobRequest(job_id="j", prompt="p", **kw)
    return Job(entry=Entry("default", "ns:jobs:q", "1000-0", {b"data": b""}), request=req,
               owner="w:tok", worker_id="w")


def _delta(ids, text, finished=False, n_out=0):
    return FakeDelta("j", ids, text, None, [], finished, "length" if finished else None, None, 3,
                     n_out)


def test_job_events_stream_and_final():
    job = _job(metadata={"a": 1})
    job.queue_started()
    assert job.on_delta(_delta([5], "x", n_out=1), 1.0) is True
    assert job.on_delta(_delta([6, 7], "yz", True, 3), 1.5) is False
    evs = [decode_event(b) for b in job.pending]
    assert [e.type for e in evs] == ["started", "token", "token", "done"]
    assert (evs[2].seq, evs[2].index, evs[2].token_ids) == (1, 1, [6, 7])
    assert evs[3].usage.completion_tokens == 3 and evs[3].metadata == {"a": 1}
    assert evs[3].text is None  # streamed jobs do not repeat the text


def test_non_streaming_job_carries_text_only_in_done():
    job = _job(stream=False)
    job.on_delta(_delta([5], "x", n_out=1), 1.0)
    job.on_delta(_delta([6], "y", True, 2), 2.0)
    evs = [decode_event(b) for b in job.pending]
    assert [e.type for e in evs] == ["done"]
    assert evs[0].text == "xy" and evs[0].token_ids == [5, 6]


def test_fast_token_encoding_matches_the_model():
    from worker.jobs import encode_token_event
    for lp in (None, [{5: -0.25, 7: -1.5}]):
        fast = decode_event(encode_token_event(3, 9, "é", [5], lp, 12.5))
        slow = decode_event(encode_event(TokenEvent(seq=3, index=9, text="é", token_ids=[5],
                                                    logprobs=lp, ts=12.5)))
        assert fast == slow


def test_batch_id_is_unique_per_owner_and_batch():
    job = _job()
    first = job.batch_id
    job.batch_no += 1
    assert job.batch_id != first and job.batch_id.startswith("tok.")


# ------------------------------------------------------------------------------------------
# resume-read
# ------------------------------------------------------------------------------------------

def _stream(*events):
    r = fakeredis.FakeRedis()
    for e in events:
        r.xadd(Keys().results("j"), {EVENT_FIELD: encode_event(e), BATCH_FIELD: b"x:1"})
    return r


def test_read_progress_of_a_partial_stream():
    r = _stream(StartedEvent(worker_id="a", seed=11),
                TokenEvent(seq=0, index=0, text="he", token_ids=[1, 2]),
                TokenEvent(seq=1, index=2, text="llo", token_ids=[3]),
                StartedEvent(worker_id="b", attempt=2, seed=11, resumed_tokens=3),
                TokenEvent(seq=2, index=3, text="!", token_ids=[4]))
    p = read_progress(r, Keys(), "j", page=2)  # paging across several XRANGE calls
    assert (p.exists, p.attempts, p.seed, p.next_seq, p.last_seq) == (True, 2, 11, 3, 2)
    assert p.token_ids == [1, 2, 3, 4] and p.text == "hello!" and not p.finished


def test_read_progress_terminal_duplicates_and_garbage():
    r = _stream(StartedEvent(worker_id="a", seed=1),
                TokenEvent(seq=0, index=0, text="a", token_ids=[1]),
                TokenEvent(seq=0, index=0, text="a", token_ids=[1]),   # duplicate: skipped
                DoneEvent(finish_reason="length"))
    r.xadd(Keys().results("j"), {EVENT_FIELD: b"\xc1"})
    p = read_progress(r, Keys(), "j")
    assert p.token_ids == [1] and p.text == "a" and p.finished and p.undecodable == 1
    assert progress_from_entries([]).exists is False


# ------------------------------------------------------------------------------------------
# settings, CLI, health
# ------------------------------------------------------------------------------------------

def test_settings_from_env_and_flags(monkeypatch):
    monkeypatch.setenv("TOKENRELAY_QUEUE", "fromenv")
    monkeypatch.setenv("TOKENRELAY_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("TOKENRELAY_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("TOKENRELAY_KV_CACHE_MEMORY", "1GiB")
    s = settings_from_args(build_parser().parse_args(["--model", "m", "--max-num-seqs", "3",
                                                      "--redis-url", "rediss://u:p@h:1/2"]))
    assert s.queue == "fromenv" and s.max_num_seqs == 3 and s.enable_prefix_caching is False
    assert s.kv_cache_memory == 2**30 and s.redis_url == "rediss://u:p@h:1/2"
    kw = s.engine_kwargs()
    assert kw["model"] == "m" and kw["max_num_seqs"] == 3 and "block_size" not in kw
    s2 = settings_from_args(build_parser().parse_args(["--enable-prefix-caching"]))
    assert s2.enable_prefix_caching is True


def test_parse_size():
    assert parse_size("512MB") == 512 * 10**6 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(123) == 123 and parse_size("77") == 77
    with pytest.raises(ValueError):
        parse_size("lots")


def test_default_worker_id_is_stable():
    a = WorkerSettings(device="cuda:1").resolved_worker_id()
    assert a == WorkerSettings(device="cuda:1").resolved_worker_id() and a.endswith("-cuda1")


def test_health_check_against_fakeredis():
    from producer_sdk.protocol import now_ms
    r, k = fakeredis.FakeRedis(), Keys()
    assert not check_health(r, k, "w")[0]
    r.hset(k.heartbeat("w"), mapping={"ts": now_ms(), "engine_loaded": 0})
    ok, why = check_health(r, k, "w")
    assert not ok and "not loaded" in why
    r.hset(k.heartbeat("w"), mapping={"engine_loaded": 1})
    assert check_health(r, k, "w")[0]
    r.hset(k.heartbeat("w"), mapping={"ts": now_ms() - 60_000})
    assert "old" in check_health(r, k, "w")[1]


def test_health_cli_exit_code_without_redis():
    out = subprocess.run([sys.executable, "-m", "worker", "health", "--worker-id", "x",
                          "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "unreachable" in out.stderr


def test_group_name():
    assert GROUP == "workers"
