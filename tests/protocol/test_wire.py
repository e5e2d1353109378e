"""Protocol v1 unit tests: keys, dedupe records, payload validation and limits, events and dead
letters. Fast: no redis-server (fakeredis for the dead letters). The resume-read is the
worker's: tests/worker/test_recovery.py."""

from __future__ import annotations

import fakeredis
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenrelay.protocol.errors import ErrorCode, ProtocolError
from tokenrelay.protocol.events import (DoneEvent, ErrorEvent, StartedEvent, TokenEvent, encode_event,
                             is_terminal)
from tokenrelay.protocol.keys import DEDUPE_SEPARATOR, Keys, dedupe_record, key_slot, parse_dedupe_record
from tokenrelay.protocol.limits import DEFAULT_LIMITS, Limits
from tokenrelay.protocol.wire import (DeadLetter, JobRequest, PROTOCOL_VERSION, decode_event, decode_job,
                           encode_job)


# ------------------------------------------------------------------------------------------
# keys
# ------------------------------------------------------------------------------------------

def test_keys_layout_and_hash_tags():
    k = Keys("ns", "q")
    assert k.lanes() == ["ns:jobs:{q}:urgent", "ns:jobs:{q}", "ns:jobs:{q}:bulk"]
    assert k.jobs_stream(-5) == "ns:jobs:{q}:urgent" and k.jobs_stream(0) == "ns:jobs:{q}"
    assert k.jobs_stream(3) == "ns:jobs:{q}:bulk"
    assert k.dead() == "ns:dead:{q}" and k.workers == "ns:workers:q"
    assert k.heartbeat("w1") == "ns:worker:w1"
    for key in (k.results("j"), k.cancel("j"), k.owner("j"), k.dedupe("j")):
        assert key.endswith(":{q}:j")
        assert key_slot(key) == key_slot(k.lane("default"))  # one slot: one script
    with pytest.raises(ValueError):
        Keys("bad:ns")
    with pytest.raises(ValueError):
        k.lane("nope")
    with pytest.raises(ValueError):
        Keys("ns", "q", shards=0)


def test_every_key_of_a_shard_shares_its_slot_and_shards_spread_over_masters():
    """The keys one script touches share the slot of their shard; the shards of a queue fall in
    different thirds (sixths, ...) of the slot space, which is how redis-cli --cluster create
    spreads slots over masters, so a 3-shard queue uses all three masters of a 3-master
    cluster."""
    for n in (2, 3, 6):
        k = Keys("ns", "q", shards=n)
        slots = []
        for s in range(n):
            slot = key_slot(k.lane("default", s))
            slots.append(slot)
            same = [*k.lanes(s), k.dead(s), k.affinity("w1", s)]
            job = next(j for j in (f"job-{i}" for i in range(10_000)) if k.shard_of(j) == s)
            same += [k.results(job), k.cancel(job), k.owner(job), k.dedupe(job)]
            assert {key_slot(key) for key in same} == {slot}
            assert s * 16384 // n <= slot < (s + 1) * 16384 // n
            assert k.shard_of_stream(k.lane("bulk", s)) == s
            assert k.shard_of_stream(k.affinity("w9", s)) == s
        assert len(set(slots)) == n
        # job ids spread over every shard, deterministically
        counts = [0] * n
        for i in range(3000):
            counts[k.shard_of(f"job-{i}")] += 1
        assert min(counts) > 3000 / n * 0.8
        assert Keys("ns", "q", shards=n).tag(n - 1) == k.tag(n - 1)


def test_drain_key_keeps_the_admin_string():
    assert Keys("ns", "q").drain("w1") == "ns:drain:q:w1"


def test_lane_order_and_mapping_live_in_keys():
    k = Keys("ns", "q")
    assert [Keys.lane_for_priority(p) for p in (-(2**31), -1, 0, 1, 2**31 - 1)] == \
        ["urgent", "urgent", "default", "bulk", "bulk"]
    assert k.lanes() == [k.lane(n) for n in Keys.LANES] and Keys.LANES[0] == "urgent"


def test_dedupe_record_roundtrip_and_rejects():
    rec = dedupe_record("ns:jobs:q:bulk", "1700000000000-3")
    assert rec == "ns:jobs:q:bulk" + DEDUPE_SEPARATOR + "1700000000000-3"
    assert parse_dedupe_record(rec) == ("ns:jobs:q:bulk", "1700000000000-3")
    assert parse_dedupe_record(rec.encode()) == ("ns:jobs:q:bulk", "1700000000000-3")
    for bad in ("", "nospace", " 1-0", "lane ", b"\xff"):
        with pytest.raises(ProtocolError):
            parse_dedupe_record(bad)


def test_new_error_code():
    assert ErrorCode.DUPLICATE_JOB_ID.value == "duplicate_job_id"


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
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": "x", "messages": []}), "messages", "j"),
    (msgpack.packb({"v": 1, "job_id": "j", "prompt": "x", "prompt_token_ids": [1]}),
     "exactly one", "j"),
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


def _payload(**fields):
    return msgpack.packb({"v": 1, "job_id": "j1", "prompt": "x", **fields}, use_bin_type=True)


@pytest.mark.parametrize("fields, field", [
    ({"stream": "yes"}, "stream"),
    ({"params": {"max_tokens": "5"}}, "params.max_tokens"),
    ({"params": {"stop": 5}}, "params.stop"),
    ({"params": {"stop": 5.0}}, "params.stop"),
    ({"params": {"stop": True}}, "params.stop"),
    ({"params": {"stop": {"a": 1}}}, "params.stop"),
    ({"params": {"stop": ["ok", 3]}}, "params.stop"),
    ({"params": {"ignore_eos": 1}}, "params.ignore_eos"),
    ({"params": {"seed": True}}, "params.seed"),
    ({"params": {"temperature": "0.5"}}, "params.temperature"),
    ({"params": {"max_token": 3}}, "params.max_token"),
    ({"params": {"min_tokens": 9, "max_tokens": 3}}, "params"),
    ({"priority": True}, "priority"),
    ({"priority": 1.0}, "priority"),
    ({"deadline_ms": "5"}, "deadline_ms"),
    ({"metadata": [1]}, "metadata"),
    ({"params": [1]}, "params"),
])
def test_strict_types_are_invalid_requests_naming_the_field(fields, field):
    with pytest.raises(ProtocolError) as exc:
        decode_job(_payload(**fields))
    assert exc.value.field == field and str(exc.value).startswith(field)
    assert exc.value.job_id == "j1" and exc.value.code is ErrorCode.INVALID_REQUEST


def test_decoded_params_cannot_fail_and_are_fresh_copies():
    req = decode_job(_payload(params={"stop": "x", "temperature": 0, "max_tokens": 4}))
    a, b = req.sampling_params(), req.sampling_params()
    assert a.stop == ["x"] and a.greedy and a.max_tokens == 4
    a.seed = 5
    assert b.seed is None and req.sampling_params().seed is None


def _nested(depth: int) -> bytes:
    """msgpack bytes of a list nested ``depth`` deep, built without recursion."""
    return b"\x91" * depth + b"\xc0"


def test_deep_metadata_still_yields_the_job_id():
    head = msgpack.packb({"v": 1, "prompt": "x"})  # fixmap of 2: splice two more keys in
    raw = (bytes([0x84]) + head[1:] + msgpack.packb("metadata") + b"\x81" + msgpack.packb("k")
           + _nested(5000) + msgpack.packb("job_id") + msgpack.packb("victim-1"))
    with pytest.raises(ProtocolError) as exc:
        decode_job(raw)
    assert exc.value.job_id == "victim-1" and "not msgpack" in str(exc.value)


def test_metadata_depth_within_msgpack_but_over_the_limit():
    deep = 0
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ProtocolError) as exc:
        decode_job(_payload(metadata={"a": deep}))
    assert exc.value.field == "metadata" and "max_metadata_depth" in str(exc.value)
    assert exc.value.job_id == "j1"


SMALL = Limits(max_payload_bytes=4096, max_prompt_bytes=100, max_prompt_token_ids=10,
               max_messages=3, max_stop_strings=2, max_stop_string_chars=5,
               max_stop_token_ids=2, max_metadata_bytes=50, max_metadata_depth=3,
               max_logprobs=2, max_n=1, max_beam_width=2)


@pytest.mark.parametrize("fields, field, name", [
    ({"prompt": "é" * 51}, "prompt", "max_prompt_bytes"),          # 102 UTF-8 bytes
    ({"prompt": None, "prompt_token_ids": list(range(11))}, "prompt_token_ids",
     "max_prompt_token_ids"),
    ({"prompt": None, "messages": [{"role": "u", "content": "a"}] * 4}, "messages",
     "max_messages"),
    ({"prompt": None, "messages": [{"role": "u", "content": "a" * 60}] * 2}, "messages",
     "max_prompt_bytes"),
    ({"params": {"stop": ["a", "b", "c"]}}, "params.stop", "max_stop_strings"),
    ({"params": {"stop": "abcdef"}}, "params.stop", "max_stop_string_chars"),
    ({"params": {"stop_token_ids": [1, 2, 3]}}, "params.stop_token_ids", "max_stop_token_ids"),
    ({"params": {"logprobs": 3}}, "params.logprobs", "max_logprobs"),
    ({"params": {"n": 2}}, "params.n", "max_n"),
    ({"params": {"beam_width": 3}}, "params.beam_width", "max_beam_width"),
    ({"metadata": {"k": "v" * 60}}, "metadata", "max_metadata_bytes"),
    ({"metadata": {"a": {"b": {"c": {}}}}}, "metadata", "max_metadata_depth"),
    ({"prompt": "x" * 5000}, None, "max_payload_bytes"),
    ({"prompt": None, "messages": [{"role": "u", "content": "a", "x": [[[[1]]]]}]}, "messages",
     "max_metadata_depth"),
])
def test_each_limit_is_an_invalid_request_naming_field_and_limit(fields, field, name):
    obj = {"v": 1, "job_id": "j1", "prompt": "x", **fields}
    raw = msgpack.packb({k: v for k, v in obj.items() if v is not None}, use_bin_type=True)
    with pytest.raises(ProtocolError) as exc:
        decode_job(raw, SMALL)
    assert exc.value.field == field and name in str(exc.value) and exc.value.job_id == "j1"
    decode_job(msgpack.packb({"v": 1, "job_id": "j1", "prompt": "x"}), SMALL)  # control


def test_default_limits_match_the_contract():
    d = DEFAULT_LIMITS
    assert (d.max_payload_bytes, d.max_prompt_bytes, d.max_metadata_bytes) == \
        (8 * 2**20, 4 * 2**20, 64 * 2**10)
    assert (d.max_prompt_token_ids, d.max_messages, d.max_stop_strings, d.max_stop_string_chars,
            d.max_stop_token_ids, d.max_metadata_depth, d.max_logprobs, d.max_n,
            d.max_beam_width) == (1_000_000, 10_000, 64, 512, 1024, 32, 20, 16, 16)


def test_oversized_payload_is_refused_before_unpacking():
    raw = msgpack.packb({"v": 1, "job_id": "big", "prompt": "x" * 10_000})
    with pytest.raises(ProtocolError) as exc:
        decode_job(raw + b"\xc1", Limits(max_payload_bytes=1000))  # garbage tail: never unpacked
    assert exc.value.job_id == "big" and "max_payload_bytes" in str(exc.value)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(),
                     st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), c,
                                             max_size=4)), max_leaves=20)
_keys = st.sampled_from(["prompt", "messages", "prompt_token_ids", "params",
                         "priority", "deadline_ms", "stream", "metadata", "submitted_ms", "x"])
_param_keys = st.sampled_from(["stop", "max_tokens", "temperature", "seed", "logprobs", "n",
                               "stop_token_ids", "ignore_eos", "top_k", "bogus"])
_jobs = st.fixed_dictionaries({"v": st.sampled_from([1, 1, 2, "1", True]),
                               "job_id": st.sampled_from(["ok-1", "a b", 5, ""])}).flatmap(
    lambda base: st.dictionaries(_keys, _values, max_size=6).flatmap(
        lambda extra: st.dictionaries(_param_keys, _values, max_size=4).map(
            lambda params: {**base, **extra, "params": params})))


def _pack_any(obj):
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        return b"\xc1"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_jobs.map(_pack_any), _jobs, st.binary(max_size=64), _values,
                 _jobs.map(_pack_any).flatmap(lambda b: st.integers(0, len(b)).map(
                     lambda n: b[:n]))))
def test_decode_job_raises_only_protocol_errors(raw):
    try:
        req = decode_job(raw)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.INVALID_REQUEST
        if exc.job_id is not None:
            assert exc.job_id == "ok-1"
        return
    req.sampling_params()  # validated: cannot fail
    assert req.job_id == "ok-1" and req.v == PROTOCOL_VERSION


def test_sampling_params_errors_name_the_field():
    job = JobRequest(job_id="j", prompt="x", params={"temperature": -1})
    with pytest.raises(Exception) as exc:
        job.sampling_params()
    assert "temperature" in str(exc.value)


# ------------------------------------------------------------------------------------------
# events
# ------------------------------------------------------------------------------------------

def test_events_roundtrip_and_terminal():
    evs = [StartedEvent(worker_id="w", seed=7), TokenEvent(seq=0, position=0, text="a", token_ids=[1],
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
    assert back.size == 0 and back.truncated is False  # older entries lack the new fields


def test_dead_letter_size_and_truncated_roundtrip():
    dl = DeadLetter(data=b"abc", reason="r", code="invalid_request", worker_id="w", lane="l",
                    entry_id="1-0", size=100_000, truncated=True)
    r = fakeredis.FakeRedis()
    r.xadd("dead", dl.to_fields())
    (_, fields), = r.xrange("dead")
    back = DeadLetter.from_fields(fields)
    assert (back.size, back.truncated, back.data) == (100_000, True, b"abc")
