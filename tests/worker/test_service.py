"""The worker's promises, in-process against a real redis-server, with the contract-shaped
FakeEngine (tests of the real engine are in tests/worker/test_real_engine.py).

Each promise has a test that breaks something: bad payloads, cancels, expired deadlines, a stop
in the middle of generation, a Redis restart, a stalled worker whose job was taken over.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest

from tokenrelay.protocol.keys import GROUP, Keys, PARKING_CONSUMER
from tokenrelay.protocol.wire import DeadLetter, now_ms
from tests.fault_harness import read_events, submit, wait_for, wait_for_terminal
from tests.fixtures_redis import REPO_ROOT
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

@pytest.fixture
def r(redis_server):
    client = redis_server.client()
    yield client
    client.close()


KEYS = Keys()


def job(job_id: str, prompt: str = "hello", max_tokens: int = 5, **kw: Any) -> dict:
    params = kw.pop("params", {"max_tokens": max_tokens, "temperature": 0})
    return {"job_id": job_id, "prompt": prompt, "params": params, **kw}


def tokens_text(events: list) -> str:
    return "".join(e.text for e in events if e.type == "token")


def terminal(events: list) -> Any:
    ends = [e for e in events if e.type in ("done", "error")]
    assert len(ends) == 1, f"expected exactly one terminal event, got {ends}"
    assert events[-1] is ends[0], "terminal event is not last"
    return ends[0]


def lane_empty(r, keys: Keys = KEYS) -> bool:
    return all(r.xlen(k) == 0 and r.xpending(k, GROUP)["pending"] == 0 for k in keys.lanes())


# ------------------------------------------------------------------------------------------
# the basic path
# ------------------------------------------------------------------------------------------

def test_streams_tokens_and_acks(start_worker, r):
    start_worker()
    submit(r, KEYS, job("j1", "hello", 6, metadata={"user": "u1"}))
    events = wait_for_terminal(r, KEYS, "j1", 10)["j1"]
    assert events[0].type == "started" and events[0].worker_id == "w1" and events[0].attempt == 1
    assert events[0].seed is not None
    assert tokens_text(events) == fake_completion("hello", 6)
    toks = [e for e in events if e.type == "token"]
    assert [e.seq for e in toks] == list(range(len(toks)))
    assert [e.position for e in toks] == list(range(6))
    done = terminal(events)
    assert done.type == "done" and done.finish_reason == "length"
    assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 6
    assert done.metadata == {"user": "u1"}
    assert done.timings.ttft_ms is not None and done.timings.total_ms >= done.timings.ttft_ms
    wait_for(lambda: lane_empty(r), what="entry acked and deleted")
    ttl = r.pttl(KEYS.results("j1"))
    assert 0 < ttl <= 120_000
    assert r.get(KEYS.owner("j1")).startswith(b"w1:")


def test_non_streaming_job_gets_only_the_final_event(start_worker, r):
    start_worker()
    submit(r, KEYS, job("ns", "abc", 4, stream=False, metadata={"k": 1}))
    events = wait_for_terminal(r, KEYS, "ns")["ns"]
    assert [e.type for e in events] == ["started", "done"]
    done = events[-1]
    assert done.text == fake_completion("abc", 4) and len(done.token_ids) == 4
    assert done.metadata == {"k": 1}


def test_messages_logprobs_token_ids_and_drawn_seed(start_worker, r):
    eng = FakeEngine()
    start_worker(engine=eng)
    submit(r, KEYS, {"job_id": "chat", "messages": [{"role": "user", "content": "hi"}],
                     "params": {"max_tokens": 3, "temperature": 0, "logprobs": 1}})
    submit(r, KEYS, {"job_id": "ids", "prompt_token_ids": [104, 105], "params": {"max_tokens": 2}})
    submit(r, KEYS, job("seeded", "x", 3, params={"max_tokens": 3, "seed": 1234}))
    out = wait_for_terminal(r, KEYS, ["chat", "ids", "seeded"])
    rendered = eng.render_chat([{"role": "user", "content": "hi"}])
    assert tokens_text(out["chat"]) == fake_completion(rendered, 3)
    assert all(e.logprobs for e in out["chat"] if e.type == "token")
    assert all(e.logprobs is None for e in out["ids"] if e.type == "token")
    assert out["ids"][-1].finish_reason == "length"
    assert out["seeded"][0].seed == 1234
    assert isinstance(out["ids"][0].seed, int)  # drawn by the worker and recorded


def test_chat_template_kwargs_reach_the_engine_and_need_messages(start_worker, r):
    eng = FakeEngine()
    start_worker(engine=eng)
    msgs = [{"role": "user", "content": "hi"}]
    submit(r, KEYS, {"job_id": "tmpl", "messages": msgs,
                     "params": {"max_tokens": 3, "temperature": 0},
                     "chat_template_kwargs": {"enable_thinking": False}})
    submit(r, KEYS, None, raw=msgpack.packb({"v": 1, **job("tmpl-prompt", "x", 3),     # raw:
                                             "chat_template_kwargs": {"enable_thinking": 0}}))
    submit(r, KEYS, None, raw=msgpack.packb({"v": 1, "job_id": "tmpl-reserved", "messages": msgs,
                                             "chat_template_kwargs": {"tokenize": True}}))
    out = wait_for_terminal(r, KEYS, ["tmpl", "tmpl-prompt", "tmpl-reserved"])
    rendered = eng.render_chat(msgs, {"enable_thinking": False})
    assert rendered.endswith("<enable_thinking=False>")
    assert tokens_text(out["tmpl"]) == fake_completion(rendered, 3)
    for bad in ("tmpl-prompt", "tmpl-reserved"):
        end = terminal(out[bad])
        assert (end.type, end.code) == ("error", "invalid_request"), end
        assert "chat_template_kwargs" in end.message


def test_many_concurrent_jobs_of_mixed_lengths(start_worker, r):
    start_worker(engine=FakeEngine(max_num_seqs=8))
    ids = [f"m{i}" for i in range(60)]
    for i, jid in enumerate(ids):
        submit(r, KEYS, job(jid, f"prompt {i}", 1 + (i * 7) % 23, priority=(i % 3) - 1))
    out = wait_for_terminal(r, KEYS, ids, 30)
    for i, jid in enumerate(ids):
        done = terminal(out[jid])
        assert done.type == "done"
        assert tokens_text(out[jid]) == fake_completion(f"prompt {i}", 1 + (i * 7) % 23)
    wait_for(lambda: lane_empty(r), what="all entries acked")


def test_reads_only_what_the_engine_can_start(start_worker, r):
    """With two workers, jobs do not pile up in one worker's pending list."""
    e1, e2 = FakeEngine(max_num_seqs=2, step_delay=0.02), FakeEngine(max_num_seqs=2,
                                                                       step_delay=0.02)
    start_worker(engine=e1, worker_id="a")
    start_worker(engine=e2, worker_id="b")
    ids = [f"c{i}" for i in range(12)]
    for jid in ids:
        submit(r, KEYS, job(jid, jid, 8))
    max_pending = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = r.xpending(KEYS.lane("default"), GROUP)
        for c in info["consumers"]:
            max_pending = max(max_pending, int(c["pending"]))
        if all(read_events(r, KEYS, j)[-1:] and read_events(r, KEYS, j)[-1].type == "done"
               for j in ids):
            break
        time.sleep(0.005)
    wait_for_terminal(r, KEYS, ids, 5)
    # capacity 2, plus at most 2 finished ones whose acks ride the next flush
    assert max_pending <= 4
    assert e1.added and e2.added, "both workers should have taken jobs"


# ------------------------------------------------------------------------------------------
# cancel, deadline, priority
# ------------------------------------------------------------------------------------------

def test_cancel_running_job_within_a_step(start_worker, r):
    eng = FakeEngine(step_delay=0.02)
    start_worker(engine=eng)
    submit(r, KEYS, job("long", "p", 500))
    wait_for(lambda: len([e for e in read_events(r, KEYS, "long") if e.type == "token"]) >= 3)
    r.set(KEYS.cancel("long"), 1, px=60_000)
    t0 = time.monotonic()
    events = wait_for_terminal(r, KEYS, "long", 5)["long"]
    done = terminal(events)
    assert done.finish_reason == "cancelled"
    ntok = len([e for e in events if e.type == "token"])
    assert done.usage.completion_tokens == ntok and 3 <= ntok < 500
    assert "long" in eng.aborted and time.monotonic() - t0 < 2
    wait_for(lambda: lane_empty(r), what="cancelled job acked")


def test_cancel_queued_job_never_starts(start_worker, r):
    r.set(KEYS.cancel("q1"), 1, px=60_000)
    submit(r, KEYS, job("q1", "p", 5))
    eng = FakeEngine()
    start_worker(engine=eng)
    events = wait_for_terminal(r, KEYS, "q1")["q1"]
    assert [e.type for e in events] == ["done"] and events[0].finish_reason == "cancelled"
    assert events[0].usage.completion_tokens == 0
    assert "q1" not in eng.added


def test_cancel_job_waiting_inside_the_engine(start_worker, r):
    """A job admitted but not yet scheduled (engine queue) is cancelled before its first token."""
    eng = FakeEngine(max_num_seqs=1, step_delay=0.02)
    eng.free_capacity = lambda: 2  # let the worker over-admit so one waits inside the engine
    start_worker(engine=eng)
    submit(r, KEYS, job("first", "a", 200))
    submit(r, KEYS, job("second", "b", 5))
    wait_for(lambda: "second" in eng.added)
    r.set(KEYS.cancel("second"), 1, px=60_000)
    events = wait_for_terminal(r, KEYS, "second", 5)["second"]
    assert terminal(events).finish_reason == "cancelled"
    assert not [e for e in events if e.type == "token"]
    r.set(KEYS.cancel("first"), 1, px=60_000)
    wait_for_terminal(r, KEYS, "first", 5)


def test_deadline_expired_before_start(start_worker, r):
    submit(r, KEYS, job("late", deadline_ms=now_ms() - 1000, metadata={"m": 2}))
    submit(r, KEYS, job("ontime", deadline_ms=now_ms() + 60_000))
    eng = FakeEngine()
    start_worker(engine=eng)
    out = wait_for_terminal(r, KEYS, ["late", "ontime"])
    err = terminal(out["late"])
    assert err.type == "error" and err.code == "expired" and "deadline_ms" in err.message
    assert err.metadata == {"m": 2}
    assert "late" not in eng.added
    assert terminal(out["ontime"]).type == "done"


def test_urgent_job_behind_200_bulk_jobs_finishes_first(start_worker, r):
    for i in range(200):
        submit(r, KEYS, job(f"b{i}", f"bulk {i}", 4, priority=5))
    submit(r, KEYS, job("urgent", "now", 4, priority=-1))
    start_worker(engine=FakeEngine(max_num_seqs=8, step_delay=0.001))
    ids = [f"b{i}" for i in range(200)] + ["urgent"]
    out = wait_for_terminal(r, KEYS, ids, 60)
    finished_at = {j: ev[-1].ts for j, ev in out.items()}
    before = sum(1 for i in range(200) if finished_at[f"b{i}"] < finished_at["urgent"])
    assert before <= 20, f"{before} bulk jobs finished before the urgent one"


# ------------------------------------------------------------------------------------------
# bad input never stops the worker
# ------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "not_msgpack": b"\xc1\xc1 definitely not msgpack",
    "not_a_map": msgpack.packb([1, 2, 3]),
    "missing_fields": msgpack.packb({"v": 1, "job_id": "bad-missing"}),
    "mistyped": msgpack.packb({"v": 1, "job_id": "bad-typed", "prompt": 42}),
    "unknown_v": msgpack.packb({"v": 99, "job_id": "bad-v", "prompt": "x"}),
    "unknown_field": msgpack.packb({"v": 1, "job_id": "bad-extra", "prompt": "x", "zzz": 1}),
    "bad_job_id": msgpack.packb({"v": 1, "job_id": "has space", "prompt": "x"}),
    "empty": b"",
}


def test_bad_input_matrix_is_dead_lettered_and_worker_keeps_serving(start_worker, r):
    start_worker()
    entry_ids = {name: submit(r, KEYS, None, raw=raw) for name, raw in BAD_INPUTS.items()}
    r.xadd(KEYS.lane("default"), {"other": b"no data field"})
    submit(r, KEYS, job("bad-params", params={"max_tokens": -3, "temperature": 0}))
    submit(r, KEYS, job("bad-params2", params={"max_token": 3}))
    submit(r, KEYS, job("too-long", "x" * 5000, 5))
    submit(r, KEYS, job("good", "still serving", 3))
    out = wait_for_terminal(r, KEYS, ["bad-missing", "bad-typed", "bad-v", "bad-extra",
                                      "bad-params", "bad-params2", "too-long", "good"])
    for jid in ("bad-missing", "bad-typed", "bad-v", "bad-extra"):
        err = terminal(out[jid])
        assert err.type == "error" and err.code == "invalid_request", (jid, err)
    assert "prompt" in terminal(out["bad-typed"]).message
    assert "v=99" in terminal(out["bad-v"]).message
    p = terminal(out["bad-params"])
    assert p.code == "invalid_request" and "params.max_tokens" in p.message
    assert "max_token" in terminal(out["bad-params2"]).message
    tl = terminal(out["too-long"])
    assert tl.code == "prompt_too_long" and "5000" in tl.message
    assert tokens_text(out["good"]) == fake_completion("still serving", 3)
    # decode_job validates params too, so both bad-params entries are dead-lettered as well
    wait_for(lambda: r.xlen(KEYS.dead()) == len(BAD_INPUTS) + 3, what="dead letters")
    letters = [DeadLetter.from_fields(f) for _, f in r.xrange(KEYS.dead())]
    by_entry = {d.entry_id: d for d in letters}
    for name, eid in entry_ids.items():
        d = by_entry[eid]
        assert d.data == BAD_INPUTS[name] and d.worker_id == "w1"
        assert d.code == "invalid_request" and d.lane == KEYS.lane("default") and d.reason
    wait_for(lambda: lane_empty(r), what="bad entries acked")


def test_bad_entry_reusing_a_live_job_id_does_not_touch_that_job(start_worker, r):
    start_worker(engine=FakeEngine(step_delay=0.01))
    submit(r, KEYS, job("live", "p", 40))
    wait_for(lambda: read_events(r, KEYS, "live"))
    submit(r, KEYS, None, raw=msgpack.packb({"v": 1, "job_id": "live", "prompt": 1}))
    events = wait_for_terminal(r, KEYS, "live", 10)["live"]
    assert terminal(events).type == "done"
    assert tokens_text(events) == fake_completion("p", 40)


# ------------------------------------------------------------------------------------------
# stop / drain / hand-back / resume
# ------------------------------------------------------------------------------------------

def test_stop_drains_running_jobs(start_worker, r):
    w = start_worker(engine=FakeEngine(step_delay=0.01))
    submit(r, KEYS, job("d1", "p", 30))
    wait_for(lambda: read_events(r, KEYS, "d1"))
    assert w.stop() == 0
    assert terminal(read_events(r, KEYS, "d1")).finish_reason == "length"
    assert lane_empty(r)
    assert not r.exists(KEYS.heartbeat("w1"))


def test_drain_timeout_hands_back_and_another_worker_resumes_at_once(start_worker, r):
    w1 = start_worker(engine=FakeEngine(step_delay=0.01), worker_id="w1", drain_timeout=0.2)
    submit(r, KEYS, job("h1", "handback", 300, params={"max_tokens": 300, "temperature": 1.0}))
    wait_for(lambda: len(read_events(r, KEYS, "h1")) > 5)
    assert w1.stop() == 0
    before = read_events(r, KEYS, "h1")
    assert not [e for e in before if e.type in ("done", "error")]
    pend = r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pend] == [PARKING_CONSUMER.encode()]
    assert pend[0]["times_delivered"] == 1
    seed = before[0].seed
    t0 = time.monotonic()
    start_worker(engine=FakeEngine(), worker_id="w2", lease_ms=60_000)
    events = wait_for_terminal(r, KEYS, "h1", 10)["h1"]
    assert time.monotonic() - t0 < 5
    starts = [e for e in events if e.type == "started"]
    assert [s.worker_id for s in starts] == ["w1", "w2"] and starts[1].attempt == 2
    assert starts[1].seed == seed and starts[1].resumed_tokens > 0
    toks = [e for e in events if e.type == "token"]
    assert [e.seq for e in toks] == list(range(len(toks)))
    assert tokens_text(events) == fake_completion("handback", 300, seed, greedy=False)
    assert terminal(events).usage.completion_tokens == 300
    wait_for(lambda: lane_empty(r), what="resumed job acked")


def test_restart_with_same_id_resumes_own_pending_entries(start_worker, r):
    """A crash leaves entries in the worker's pending list; the same id re-reads them (ID 0)."""
    keys = KEYS
    r.xgroup_create(keys.lane("default"), GROUP, id="0", mkstream=True)
    submit(r, keys, job("own", "mine", 6))
    r.xreadgroup(GROUP, "w1", {keys.lane("default"): ">"}, count=10)  # "crashed" after reading
    start_worker(worker_id="w1")
    events = wait_for_terminal(r, keys, "own")["own"]
    assert tokens_text(events) == fake_completion("mine", 6)


def test_stalled_worker_is_fenced_out_after_takeover(start_worker, r):
    """A paused worker whose job was reclaimed writes nothing more and acks nothing."""
    gate = threading.Event()
    eng = FakeEngine(fail_on=None)
    orig_step = eng.step

    def paused_step():
        out = orig_step()
        if eng.num_steps == 3:
            gate.wait(20)  # the "GC pause"
        return out

    eng.step = paused_step
    w1 = start_worker(engine=eng, worker_id="w1")
    submit(r, KEYS, job("stall", "s", 50))
    wait_for(lambda: eng.num_steps >= 3)
    # another worker takes the entry over (what F's reclaim does) and takes ownership
    lane = KEYS.lane("default")
    eid = r.xpending_range(lane, GROUP, "-", "+", 1)[0]["message_id"]
    r.xclaim(lane, GROUP, "w2", 0, [eid], justid=True)
    r.set(KEYS.owner("stall"), "w2:tok", px=60_000)
    n_before = r.xlen(KEYS.results("stall"))
    gate.set()
    wait_for(lambda: "stall" not in w1.worker.jobs, what="w1 drops the job")
    assert r.xlen(KEYS.results("stall")) == n_before
    pend = r.xpending_range(lane, GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pend] == [b"w2"]  # not acked away by w1


def test_result_stream_expired_is_never_recreated(start_worker, r):
    eng = FakeEngine(step_delay=0.02)
    start_worker(engine=eng)
    submit(r, KEYS, job("exp", "p", 400))
    wait_for(lambda: r.xlen(KEYS.results("exp")) > 2)
    r.delete(KEYS.results("exp"))  # what expiry does
    wait_for(lambda: "exp" in eng.aborted, what="job abandoned")
    time.sleep(0.1)
    assert not r.exists(KEYS.results("exp"))
    wait_for(lambda: lane_empty(r), what="abandoned job acked")


def test_engine_failure_hands_jobs_back_and_exits_nonzero(start_worker, r):
    # F's fault-tolerance contract: a step that raises leaves the engine suspect, so the worker
    # hands back what it holds (counting a delivery: the cause may be a poison prompt) and exits
    # 1 for its supervisor; the next worker resumes the job.
    def fail_on(ids):
        return "poison" in ids

    broken = start_worker(engine=FakeEngine(fail_on=fail_on))
    submit(r, KEYS, job("poison", "p", 5))
    broken.thread.join(15)
    assert broken.result == [1]
    (row,) = r.xpending_range(KEYS.lane("default"), GROUP, min="-", max="+", count=10)
    assert row["consumer"] == b"w1" and row["time_since_delivered"] > 10**9  # handed back
    start_worker(worker_id="w2")
    out = wait_for_terminal(r, KEYS, "poison", 10)
    assert tokens_text(out["poison"]) == fake_completion("p", 5)
    submit(r, KEYS, job("fine", "ok", 4))
    assert tokens_text(wait_for_terminal(r, KEYS, "fine")["fine"]) == fake_completion("ok", 4)


# ------------------------------------------------------------------------------------------
# Redis goes away
# ------------------------------------------------------------------------------------------

def test_redis_restart_mid_run_every_job_completes(redis_server_factory, start_worker):
    srv = redis_server_factory("--appendonly", "yes", "--appendfsync", "always")
    r = srv.client()
    w = start_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01),
                     redis_url=srv.url)
    ids = [f"rr{i}" for i in range(12)]
    for i, jid in enumerate(ids):
        submit(r, KEYS, job(jid, f"restart {i}", 20 + i))
    wait_for(lambda: r.exists(KEYS.results("rr0")))
    srv.kill()
    time.sleep(0.5)
    srv.start()
    r = srv.client()
    out = wait_for_terminal(r, KEYS, ids, 40)
    for i, jid in enumerate(ids):
        assert terminal(out[jid]).type == "done"
        toks = [e for e in out[jid] if e.type == "token"]
        assert [e.seq for e in toks] == list(range(len(toks))), jid
        assert tokens_text(out[jid]) == fake_completion(f"restart {i}", 20 + i), jid
    wait_for(lambda: lane_empty(r), what="all acked after restart")
    assert w.worker.metrics.redis_reconnects._value.get() >= 1


def test_redis_unreachable_at_start_then_appears(redis_server_factory, start_worker, tmp_path):
    from tests.fixtures_redis import RedisServer
    srv = RedisServer(dir=tmp_path / "late")
    w = start_worker(redis_url=srv.url, wait=False)
    time.sleep(0.6)
    assert w.thread.is_alive() and not w.worker.ready.is_set()
    srv.start()
    try:
        assert w.worker.ready.wait(15)
        r = srv.client()
        submit(r, KEYS, job("late-redis", "x", 3))
        wait_for_terminal(r, KEYS, "late-redis", 10)
    finally:
        w.stop(force=True)
        srv.kill()


def test_nogroup_recreates_group(start_worker, r):
    start_worker()
    submit(r, KEYS, job("g1", "x", 2))
    wait_for_terminal(r, KEYS, "g1")
    for k in KEYS.lanes():
        r.delete(k)  # like a restart without persistence
    submit(r, KEYS, job("g2", "y", 2))   # XADD makes the lane again, without the group
    out = wait_for_terminal(r, KEYS, "g2", 10)
    assert tokens_text(out["g2"]) == fake_completion("y", 2)
    assert [g["name"] for g in r.xinfo_groups(KEYS.lane("default"))] == [GROUP.encode()]


# ------------------------------------------------------------------------------------------
# heartbeat and metrics
# ------------------------------------------------------------------------------------------

def test_heartbeat_and_health_check(start_worker, r):
    from tokenrelay.worker.health import check_health
    w = start_worker(worker_id="hb1")
    wait_for(lambda: r.exists(KEYS.heartbeat("hb1")))
    beat = r.hgetall(KEYS.heartbeat("hb1"))
    assert beat[b"engine_loaded"] == b"1"
    assert 0 < r.pttl(KEYS.heartbeat("hb1")) <= 5 * 200
    assert r.zscore(KEYS.workers, "hb1") > 0
    assert check_health(r, KEYS, "hb1", 200)[0]
    assert not check_health(r, KEYS, "nobody", 200)[0]
    w.stop()
    assert not check_health(r, KEYS, "hb1", 200)[0]


def test_metrics_endpoint(start_worker, r):
    import urllib.request
    from tests.fixtures_redis import free_port
    port = free_port()
    start_worker(metrics_port=port, metrics_host="127.0.0.1")
    submit(r, KEYS, job("met", "x", 3))
    submit(r, KEYS, None, raw=b"\xc1")
    wait_for_terminal(r, KEYS, "met")
    wait_for(lambda: r.xlen(KEYS.dead()) == 1)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("tokenrelay_num_requests_running", "tokenrelay_num_requests_waiting",
                 "tokenrelay_request_queue_time_seconds_bucket",
                 "tokenrelay_time_to_first_token_seconds_bucket",
                 "tokenrelay_inter_token_latency_seconds_bucket",
                 "tokenrelay_e2e_request_latency_seconds_bucket",
                 "tokenrelay_prompt_tokens_total", 'tokenrelay_generation_tokens_total{model_name='
                 '"fake"} 3.0', "tokenrelay_kv_cache_usage_perc",
                 "tokenrelay_prefix_cache_queries_total", "tokenrelay_prefix_cache_hits_total",
                 "tokenrelay_num_preemptions_total", 'tokenrelay_request_errors_total{code='
                 '"invalid_request",model_name="fake"} 1.0'):
        assert name in body, name
    samples = [line for line in body.splitlines() if line.startswith("tokenrelay_")]
    assert samples and all('model_name="fake"' in line for line in samples), samples[:5]
    assert "hit_rate" not in body           # a ratio gauge cannot be summed across workers
    documented = (REPO_ROOT / "docs" / "operations.md").read_text()
    for metric in {line.split("{")[0].split(" ")[0] for line in samples}:
        base = metric.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        if base.endswith("_created"):
            continue
        assert f"`{base}" in documented, f"{base} is exported but not in docs/operations.md"
