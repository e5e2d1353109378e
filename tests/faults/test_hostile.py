"""Issue #13's findings, reproduced black-box: a hostile or careless producer XADDs raw entries
to a real ``tokenrelay worker --model fake:`` on a real redis-server, and each test checks what
every client sees.

Finding 2 (Redis out of memory) is tested with the worker's own fault tests; finding 5 (SDK
threads) with the SDK's. Bad entries go on the lane before the worker starts, so its first read
takes them together with the valid jobs beside them (one batch, as in the findings).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import msgpack
import pytest

from tokenrelay.protocol.keys import PAYLOAD_FIELD, parse_dedupe_record
from tokenrelay.protocol.wire import DeadLetter
from tests.fault_harness import FaultEnv, check_stream, pending_summary, wait_for
from tests.fixtures_redis import REPO_ROOT
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(120)
MAX_TOKENS = 6


@pytest.fixture
def env(request, tmp_path) -> FaultEnv:
    e = FaultEnv(tmp_path, namespace="hostile")
    request.addfinalizer(e.close)
    return e


def job(job_id: str, prompt: Any = None, **fields: Any) -> dict:
    """A protocol v1 payload as a raw producer builds it (greedy, so outputs are predictable)."""
    out = {"v": 1, "job_id": job_id, "prompt": prompt or f"prompt of {job_id}",
           "params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}}
    for k, v in fields.items():
        if k == "params":
            out["params"] = {**out["params"], **v}
        else:
            out[k] = v
    return out


def xadd(env: FaultEnv, payload: Any) -> str:
    """XADD a dict (packed here) or raw bytes onto the default lane, with no dedupe record."""
    raw = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
    eid = env.r.xadd(env.keys.lane("default"), {PAYLOAD_FIELD: raw})
    return eid.decode()


def events(env: FaultEnv, job_id: str) -> list:
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    return [decode_event(f[EVENT_FIELD]) for _, f in env.r.xrange(env.keys.results(job_id))]


def dead_letters(env: FaultEnv) -> list[tuple[str, DeadLetter]]:
    return [(eid.decode(), DeadLetter.from_fields(f)) for eid, f in env.r.xrange(env.keys.dead())]


def assert_rejected(env: FaultEnv, job_id: str, code: str, names: str = "") -> None:
    """The job's stream holds exactly one event: an error with ``code`` whose message names
    the bad field (when ``names`` is given)."""
    evs = events(env, job_id)
    assert [e.type for e in evs] == ["error"], f"{job_id}: {evs}"
    assert evs[0].code == code, f"{job_id}: {evs[0]}"
    assert names in evs[0].message, f"{job_id}: message does not name {names}: {evs[0].message}"


def assert_done(env: FaultEnv, job_id: str, prompt: str, max_tokens: int = MAX_TOKENS) -> None:
    rep = check_stream(env.r, env.keys, job_id)
    assert rep.kind == "done:length" and not rep.problems, f"{job_id}: {rep.kind} {rep.problems}"
    assert rep.text == fake_completion(prompt, max_tokens), job_id


def assert_worker_serving(env: FaultEnv, wp, tag: str) -> None:
    """The worker process never exited and still runs a new job to the end."""
    assert wp.proc.poll() is None, f"worker exited with {wp.proc.returncode}:\n{env.logs()}"
    xadd(env, job(f"after-{tag}"))
    env.wait_ended([f"after-{tag}"], timeout=30)
    assert_done(env, f"after-{tag}", f"prompt of after-{tag}")
    wait_for(lambda: not pending_summary(env.r, env.keys), 20, what="every entry acknowledged")


def nested_map(depth: int) -> bytes:
    """msgpack for {"a": {"a": ... nil}} ``depth`` levels deep (msgpack-python's packer refuses
    to build it, which is the point: a producer in another language can)."""
    return b"\x81\xa1a" * depth + b"\xc0"


def packed_map(*pairs: tuple[str, bytes]) -> bytes:
    """A top-level map from (key, already-packed value) pairs, in the given order."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + v for k, v in pairs)


def deep_job(job_id: str, depth: int, id_first: bool) -> bytes:
    head = [("v", msgpack.packb(1)), ("prompt", msgpack.packb("deep"))]
    ident = [("job_id", msgpack.packb(job_id))]
    meta = [("metadata", nested_map(depth))]
    return packed_map(*(head + ident + meta if id_first else head + meta + ident))


# 1 ---------------------------------------------------------------------------------------------
def test_non_string_stop_fails_its_job_alone(env):
    """``"stop": 5`` (and 5.0, True) beside valid jobs in one read: each bad job gets one
    invalid_request error naming params.stop, the valid ones finish, the worker stays up."""
    bad = {"stop-int": 5, "stop-float": 5.0, "stop-bool": True}
    valid = [f"valid-{i}" for i in range(3)]
    for v, (b, stop) in zip(valid, bad.items()):
        xadd(env, job(v))
        xadd(env, job(b, params={"stop": stop}))
    wp = env.worker("w1")
    env.wait_ended(valid + list(bad), timeout=30)
    for b in bad:
        assert_rejected(env, b, "invalid_request", "params.stop")
    for v in valid:
        assert_done(env, v, f"prompt of {v}")
    assert_worker_serving(env, wp, "stops")


# 3 ---------------------------------------------------------------------------------------------
def test_dead_letter_stream_is_capped_and_payloads_truncated(tmp_path, request):
    """200 invalid payloads of 100 KB (half not msgpack, half with a readable job id): the
    dead-letter stream keeps at most --dead-letter-maxlen letters (approximate trimming: plus
    one stream node, 10 entries here) of at most --dead-letter-payload-bytes each, each with
    the original size and truncated=True; jobs with an id get their error event."""
    env = FaultEnv(tmp_path, namespace="dlcap", redis_args=("--stream-node-max-entries", "10"))
    request.addfinalizer(env.close)
    maxlen, keep = 20, 1024
    big = 100_000
    pipe = env.r.pipeline(transaction=False)
    sizes = {}
    for i in range(200):
        if i % 2:
            raw = b"\xc1" + bytes([i % 251]) * (big - 1)          # 0xc1: never valid msgpack
        else:
            raw = msgpack.packb(job(f"dl-{i}", prompt=5, pad="x" * big), use_bin_type=True)
        sizes[len(raw)] = True
        pipe.xadd(env.keys.lane("default"), {PAYLOAD_FIELD: raw})
    pipe.execute()
    wp = env.worker("w1", dead_letter_maxlen=maxlen, dead_letter_payload_bytes=keep)
    wait_for(lambda: env.r.xlen(env.keys.lane("default")) == 0 and not pending_summary(
        env.r, env.keys), 60, what="all 200 bad entries dead-lettered and acknowledged")
    letters = dead_letters(env)
    assert 0 < len(letters) <= maxlen + 10, f"{len(letters)} dead letters kept"
    for _, letter in letters:
        assert len(letter.data) <= keep and letter.truncated, letter.model_dump(exclude={"data"})
        assert letter.size in sizes, letter.size
    usage = env.r.memory_usage(env.keys.dead()) or 0
    assert usage < (maxlen + 10) * (keep + 1024), f"dead-letter stream holds {usage} bytes"
    env.wait_ended([f"dl-{i}" for i in range(0, 200, 2)], timeout=30)
    assert_rejected(env, "dl-0", "invalid_request", "prompt")
    assert_worker_serving(env, wp, "dead")


# 4 ---------------------------------------------------------------------------------------------
def test_reused_job_id_never_touches_the_victims_stream(env):
    """A raw XADD reusing a running job's id (another producer's job): two workers are up, so
    the attacker entry is read by one while the other runs the victim. The victim's stream stays
    its own (its tokens, its metadata on done, one start), the attacker entry is dead-lettered
    as duplicate_job_id; the same again after the victim finished."""
    env.worker("w1")
    env.worker("w2")
    client = env.client()
    victim = client.submit("victim prompt", job_id="victim", max_tokens=150, temperature=0.0,
                           metadata={"owner": "victim"})
    wait_for(lambda: len(check_stream(env.r, env.keys, "victim").token_ids) >= 3, 30,
             what="the victim running")
    attack = job("victim", prompt="attacker prompt", params={"max_tokens": 150},
                 metadata={"owner": "attacker"})
    first = xadd(env, attack)
    result = victim.result(timeout=60)
    assert result.text == fake_completion("victim prompt", 150)
    assert result.metadata == {"owner": "victim"}
    rep = check_stream(env.r, env.keys, "victim")
    assert not rep.problems and len(rep.started) == 1, (rep.problems, rep.started)

    def rejected(entry_id: str) -> bool:
        return any(d.entry_id == entry_id and d.code == "duplicate_job_id"
                   and d.job_id == "victim" for _, d in dead_letters(env))
    wait_for(lambda: rejected(first), 30, what="the attacker entry dead-lettered")
    before = env.r.xrange(env.keys.results("victim"))
    second = xadd(env, attack)                           # the victim has finished by now
    wait_for(lambda: rejected(second), 30, what="the second attacker entry dead-lettered")
    assert env.r.xrange(env.keys.results("victim")) == before
    wait_for(lambda: not pending_summary(env.r, env.keys), 20, what="every entry acknowledged")


def test_raw_producer_without_dedupe_record_gets_its_job_run(env):
    """A producer in another language that only XADDs: the worker creates the job's record
    (naming this entry) and runs it."""
    env.worker("w1")
    entry = xadd(env, job("raw-1"))
    env.wait_ended(["raw-1"], timeout=30)
    assert_done(env, "raw-1", "prompt of raw-1")
    record = env.r.get(env.keys.dedupe("raw-1"))
    assert record is not None and parse_dedupe_record(record) == (env.keys.lane("default"),
                                                                  entry)


def test_admin_replay_of_a_dead_letter_runs_the_job(env):
    """A job dead-lettered as poison, replayed with ``tokenrelay admin dead replay`` while
    an idle worker blocks on the lane, runs under its own id (the record names the new entry
    before any worker can read it: not a duplicate_job_id)."""
    poisoned = env.worker("w0", env={"TOKENRELAY_FAULT_INJECT": "raise_on_prompt:POISON"},
                          max_deliveries=1)
    env.client().submit("POISON pill", job_id="pill", max_tokens=MAX_TOKENS, temperature=0.0)
    assert poisoned.proc.wait(60) == 1
    wait_for(lambda: [e.type for e in events(env, "pill")][-1:] == ["error"], 30,
             what="the poison error event")
    env.worker("w1")
    out = subprocess.run(
        [sys.executable, "-m", "tokenrelay.worker", "admin", "--redis-url", env.redis.url, "--namespace",
         env.keys.namespace, "--queue", env.keys.queue, "dead", "replay", "--all"],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "replayed pill" in out.stdout, out.stdout + out.stderr
    env.wait_ended(["pill"], timeout=30)
    assert_done(env, "pill", "POISON pill")
    assert not [d for _, d in dead_letters(env) if d.code == "duplicate_job_id"]


# 6 ---------------------------------------------------------------------------------------------
def test_unbounded_and_mistyped_fields_fail_their_job_alone(env):
    """Metadata nested 5,000 deep (job id before or after it), ``"stream": "yes"``,
    ``"max_tokens": "5"`` and 1,000 stop strings, beside valid jobs in one read: one
    invalid_request error each (naming the field; msgpack itself cannot name one inside a
    too-deep value), no hang, the valid jobs finish."""
    xadd(env, job("ok-0"))
    xadd(env, deep_job("deep-id-first", 5000, id_first=True))
    xadd(env, deep_job("deep-id-last", 5000, id_first=False))
    xadd(env, job("ok-1"))
    xadd(env, job("stream-yes", stream="yes"))
    xadd(env, job("tokens-str", params={"max_tokens": "5"}))
    xadd(env, job("many-stops", params={"stop": [f"s{i}" for i in range(1000)]}))
    xadd(env, job("ok-2"))
    wp = env.worker("w1")
    expect = {"deep-id-first": "", "deep-id-last": "", "stream-yes": "stream",
              "tokens-str": "params.max_tokens", "many-stops": "params.stop"}
    env.wait_ended(["ok-0", "ok-1", "ok-2", *expect], timeout=30)
    for job_id, field_name in expect.items():
        assert_rejected(env, job_id, "invalid_request", field_name)
    for i in range(3):
        assert_done(env, f"ok-{i}", f"prompt of ok-{i}")
    assert_worker_serving(env, wp, "limits")
