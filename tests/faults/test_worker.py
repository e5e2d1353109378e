"""Fault tolerance of ``tokenrelay worker`` processes: kills, pauses, restarts, poison, drains.

Each scenario runs real worker subprocesses against a real redis-server and checks what a client
sees: every result stream holds each token exactly once (seq contiguous from 0) and ends exactly
once, and nothing is left pending. Scenario 1 runs the real engine on a tiny checkpoint (greedy
parity with ``LLM.generate``); the others run the contract-shaped FakeEngine behind the same
service so a process starts in seconds (tokens are a pure function of prompt, seed and position,
so resumed output is still checked exactly).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.fault_harness import FaultEnv, assert_resumed_like_offline, wait_for
from tokenrelay.worker.fake_engine import fake_completion


@pytest.fixture
def aof_env(request, tmp_path):
    e = FaultEnv(tmp_path, redis_args=("--appendonly", "yes", "--appendfsync", "everysec"))
    request.addfinalizer(e.close)
    return e


def prompts(n: int, tag: str = "p") -> list[str]:
    return [f"{tag} number {i} says hello" for i in range(n)]


# 1 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_sigkill_mid_stream_second_worker_resumes_exactly(env, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    real = {"max-num-seqs": 32, "dtype": "float32"}
    workers = {wid: env.worker(wid, model=model, wait=False, **real) for wid in ("w1", "w2")}
    for w in workers.values():                            # load both at once: saves a minute
        w.wait_for_log("worker ready", timeout=180)
    texts = prompts(20)
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    jobs = env.submit(texts, **params)
    # Jobs with three sampled choices each: every choice resumes from what it delivered.
    n_texts = prompts(4, "several")
    n_params = dict(max_tokens=40, temperature=1.0, seed=5, n=3, ignore_eos=True)
    n_jobs = env.submit(n_texts, prefix="n3", **n_params)
    wait_for(lambda: env.tokens_streamed(jobs) >= 20 * 8, 60, what="tokens flowing")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    survivor = "w2" if victim == "w1" else "w1"
    held = env.held_by(victim)
    workers[victim].kill()                                # SIGKILL, mid-generation
    reports = env.wait_ended(jobs + n_jobs, timeout=120)
    env.assert_exactly_once(reports)
    from tokenrelay.engine.llm import LLM
    from tokenrelay.engine.sampling_params import SamplingParams
    llm = LLM(model, device="cpu", dtype="float32")
    offline = llm.generate(texts, SamplingParams(**params))
    for job_id, out in zip(n_jobs, llm.generate(n_texts, SamplingParams(**n_params))):
        rep = reports[job_id]
        assert rep.kind == "done:length"
        assert sorted(rep.choices) == [0, 1, 2]
        for c in out.outputs:
            assert rep.choices[c.index].token_ids == c.token_ids, (job_id, c.index)
            assert rep.choices[c.index].text == c.text, (job_id, c.index)
    assert_resumed_like_offline(reports, jobs, offline, held, survivor)


def started_ids(env, job_ids) -> dict[str, list[str]]:
    """Result-stream entry ids (time-ordered) of each job's ``started`` events."""
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    out = {}
    for j in job_ids:
        out[j] = [eid.decode() for eid, f in env.r.xrange(env.keys.results(j))
                  if decode_event(f[EVENT_FIELD]).type == "started"]
    return out


def log_events(wp, event: str) -> list[dict]:
    """The worker's JSON log records named ``event``."""
    import json
    out = []
    for line in wp.log().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def assert_fake_outputs(reports, texts_by_job, max_tokens) -> None:
    for job_id, prompt in texts_by_job.items():
        rep = reports[job_id]
        assert rep.kind == "done:length", (job_id, rep.kind)
        assert rep.text == fake_completion(prompt, max_tokens), job_id


# 2 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_restart_same_id_takes_its_own_pending_jobs_first(env):
    w = env.worker("w1", max_num_seqs=4, lease_ms=60_000, delay=0.05)
    old_texts = prompts(4, "old")
    old = env.submit(old_texts, prefix="old", max_tokens=60, temperature=0.0)
    wait_for(lambda: all(len(r.token_ids) >= 3 for r in env.streams(old).values()), 30,
             what="old jobs streaming")
    w.kill()
    new_texts = prompts(8, "new")
    new = env.submit(new_texts, prefix="new", max_tokens=5, temperature=0.0)
    env.worker("w1", max_num_seqs=4, lease_ms=60_000, delay=0.05)
    reports = env.wait_ended(old + new, timeout=60)
    env.assert_exactly_once(reports)
    assert_fake_outputs(reports, dict(zip(old, old_texts)), 60)
    assert_fake_outputs(reports, dict(zip(new, new_texts)), 5)
    starts = started_ids(env, old + new)
    resumed_at = max(entry_key(starts[j][-1]) for j in old)
    first_new = min(entry_key(starts[j][0]) for j in new)
    assert all(len(starts[j]) == 2 for j in old)
    assert resumed_at < first_new, "a new job started before the worker's own pending ones"


# 3 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_long_generation_is_not_reclaimed_from_a_live_worker(env):
    env.worker("w1", lease_ms=1000, delay=0.05)
    env.worker("w2", lease_ms=1000, delay=0.05)
    (job,) = env.submit(["a long one"], prefix="long", max_tokens=140, temperature=0.0)
    t0 = time.monotonic()
    reports = env.wait_ended([job], timeout=60)
    assert time.monotonic() - t0 > 5 * 1.0, "generation was shorter than 5 lease periods"
    env.assert_exactly_once(reports)
    rep = reports[job]
    assert rep.kind == "done:length" and rep.text == fake_completion("a long one", 140)
    assert len(rep.started) == 1, "the job was taken from its live worker"
    assert "lease lost" not in env.logs() and "ownership lost" not in env.logs()


# 4 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_paused_worker_wakes_fenced_out_and_job_ends_once(env):
    w1 = env.worker("w1", lease_ms=1000, delay=0.05)
    (job,) = env.submit(["pause me"], prefix="stop", max_tokens=100, temperature=0.0)
    wait_for(lambda: len(env.streams([job])[job].token_ids) >= 5, 30, what="w1 streaming")
    w2 = env.worker("w2", lease_ms=1000, delay=0.05, wait=False)
    w1.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    w2.wait_for_log("worker ready", timeout=60)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - paused_at)))     # w1's lease runs out
    # Reclaimed within about one lease period of the owner going silent (reclaim runs every
    # lease/6, the lease is renewed every lease/3).
    wait_for(lambda: len(env.streams([job])[job].started) == 2, 2.5, what="w2 takes over")
    wait_for(lambda: len(env.streams([job])[job].token_ids) >= 30, 30, what="w2 streaming")
    w1.signal(signal.SIGCONT)
    reports = env.wait_ended([job], timeout=60)
    env.assert_exactly_once(reports)
    rep = reports[job]
    assert rep.kind == "done:length" and rep.text == fake_completion("pause me", 100)
    assert [s.worker_id for s in rep.started] == ["w1", "w2"]
    w1.wait_for_log("dropped", timeout=20)              # fenced out, aborted in its engine
    assert not [e for e in log_events(w1, "acked") if e.get("job_id") == job]
    (after,) = env.submit(["still serving"], prefix="after", max_tokens=5, temperature=0.0)
    assert env.wait_ended([after], timeout=30)[after].kind == "done:length"


# 6 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_cancel_while_the_job_is_being_reclaimed_ends_it_cancelled_once(env):
    w1 = env.worker("w1", lease_ms=1000, delay=0.05)
    w2 = env.worker("w2", lease_ms=1000, delay=0.05, wait=False)
    (job,) = env.submit(["cancel me"], prefix="cx", max_tokens=200, temperature=0.0)
    holder = w1
    wait_for(lambda: len(env.streams([job])[job].token_ids) >= 3, 30, what="streaming")
    w2.wait_for_log("worker ready", timeout=60)
    holder_id = env.streams([job])[job].started[0].worker_id
    holder, other = (w1, w2) if holder_id == "w1" else (w2, w1)
    holder.kill()
    env.client().cancel(job)                  # lands while the entry waits to be reclaimed
    reports = env.wait_ended([job], timeout=30)
    env.assert_exactly_once(reports)
    assert reports[job].kind == "done:cancelled"
    time.sleep(1.5)                            # nobody writes after the terminal event
    assert env.streams([job])[job].problems == []


# 7 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_redis_sigkill_and_restart_with_aof_loses_nothing(aof_env):
    env = aof_env
    env.worker("w1", max_num_seqs=4, delay=0.05, lease_ms=1500)
    env.worker("w2", max_num_seqs=4, delay=0.05, lease_ms=1500)
    texts = prompts(30, "aof")
    jobs = env.submit(texts, prefix="aof", max_tokens=30, temperature=0.0)
    wait_for(lambda: env.tokens_streamed(jobs) >= 40, 30, what="tokens flowing")
    groups_before = {lane: env.r.xinfo_groups(lane)[0]["name"] for lane in env.keys.lanes()}
    time.sleep(1.1)                            # let everysec fsync what is there
    pending_before = {p[0] for p in __import__("tests.fault_harness", fromlist=["x"])
                      .pending_summary(env.r, env.keys)}
    env.redis.kill()                           # SIGKILL
    time.sleep(0.5)
    env.redis.start()
    env.r = env.redis.client(socket_timeout=10)
    assert {lane: env.r.xinfo_groups(lane)[0]["name"] for lane in env.keys.lanes()} == groups_before
    from tests.fault_harness import pending_summary
    survived = {p[0] for p in pending_summary(env.r, env.keys)}
    assert pending_before and pending_before <= survived | {
        j for j in pending_before if not env.r.xrange(env.keys.lane("default"), j, j)}
    reports = env.wait_ended(jobs, timeout=90)
    env.assert_exactly_once(reports)
    assert_fake_outputs(reports, dict(zip(jobs, texts)), 30)


# 8 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_connection_killed_during_blocking_read_strands_nothing(env):
    from tokenrelay.protocol.keys import PAYLOAD_FIELD
    from tokenrelay.protocol.wire import JobRequest, encode_job
    w = env.worker("w1", lease_ms=60_000, block_ms=2000)
    time.sleep(0.5)                            # idle: blocked in XREADGROUP
    # Enqueue three jobs and deliver them to w1's pending list behind its back in one
    # transaction (its blocked read sees nothing new): a reply lost with a broken connection
    # leaves exactly this. Then break the connection it is blocked on. The 60 s lease rules out
    # rescue by reclaim: only re-reading its own pending list after reconnecting saves them.
    lane = env.keys.lane("default")
    jobs = [f"lost-{i}" for i in range(3)]
    pipe = env.r.pipeline(transaction=True)
    for j in jobs:
        pipe.xadd(lane, {PAYLOAD_FIELD: encode_job(JobRequest(
            job_id=j, prompt=f"lost {j}", params={"max_tokens": 5, "temperature": 0.0}))})
    pipe.xreadgroup("workers", "w1", {lane: ">"}, count=10)
    stolen = pipe.execute()[-1]
    assert len(stolen[0][1]) == 3
    assert env.r.client_kill_filter(_type="normal", skipme=True) >= 1
    more = env.submit(prompts(2, "after"), prefix="after", max_tokens=5, temperature=0.0)
    reports = env.wait_ended(jobs + more, timeout=20)
    env.assert_exactly_once(reports)
    assert log_events(w, "redis connection lost")
    assert {e["entry_id"] for e in log_events(w, "received") if e["source"] == "pending"} == {
        eid.decode() for eid, _ in stolen[0][1]}


# 9 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_sigterm_drain_timeout_hands_back_without_counting_a_delivery(env):
    w1 = env.worker("w1", drain_timeout=1, delay=0.05)
    texts = prompts(4, "drain")
    jobs = env.submit(texts, prefix="drain", max_tokens=120, temperature=0.0)
    wait_for(lambda: all(len(r.token_ids) >= 3 for r in env.streams(jobs).values()), 30,
             what="all four streaming")
    w1.terminate()
    assert w1.wait(15) == 0
    from tokenrelay.protocol.keys import PARKING_CONSUMER
    from tests.fault_harness import pending_summary
    parked = pending_summary(env.r, env.keys)
    assert len(parked) == 4
    assert all(who == PARKING_CONSUMER and deliveries == 1 for _, who, _, deliveries in parked)
    w2 = env.worker("w2", delay=0.01)
    reports = env.wait_ended(jobs, timeout=60)
    env.assert_exactly_once(reports)
    assert_fake_outputs(reports, dict(zip(jobs, texts)), 120)
    assert all(r.started[-1].worker_id == "w2" and r.started[-1].resumed_tokens > 0
               for r in reports.values())
    assert {e["deliveries"] for e in log_events(w2, "received")} == {1}


# 5 ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_poison_job_is_dead_lettered_after_max_deliveries_others_unaffected(env):
    inject = {"TOKENRELAY_FAULT_INJECT": "raise_on_prompt:POISON"}
    w = env.worker("w1", env=inject, max_deliveries=3)
    texts = prompts(6, "fine")
    fine = env.submit(texts[:3], prefix="fine-a", max_tokens=20, temperature=0.0)
    (bad,) = env.submit(["this is POISON"], prefix="bad", max_tokens=20, temperature=0.0)
    fine += env.submit(texts[3:], prefix="fine-b", max_tokens=20, temperature=0.0)
    exits = []
    deadline = time.monotonic() + 90
    while not env.streams([bad])[bad].ended or len(exits) < 3:      # the supervisor
        if w.proc.poll() is not None:
            exits.append(w.proc.returncode)
            w = env.worker("w1", env=inject, max_deliveries=3)
        assert time.monotonic() < deadline, f"exits so far {exits}\n{env.logs()}"
        time.sleep(0.1)
    reports = env.wait_ended(fine + [bad], timeout=60)
    env.assert_exactly_once(reports)
    assert exits == [1, 1, 1]                   # one crash per allowed delivery, then no more
    assert reports[bad].kind == "error:poison"
    from tokenrelay.worker.admin import list_dead
    (letter,) = [d for _, d in list_dead(env.r, env.keys)]
    assert letter.job_id == bad and letter.code == "poison" and letter.deliveries == 3
    assert_fake_outputs(reports, {j: t for j, t in zip(fine, texts)}, 20)
    assert w.proc.poll() is None                # the last worker lives on


def test_second_live_worker_with_the_same_id_is_refused(env):
    w = env.worker("w1")
    dup = env.worker("w1", wait=False)
    assert dup.wait(30) == 3
    assert "worker id in use" in dup.log()
    (job,) = env.submit(["still me"], prefix="one", max_tokens=5, temperature=0.0)
    assert env.wait_ended([job], timeout=20)[job].kind == "done:length"
    assert w.proc.poll() is None


@pytest.mark.timeout(60)
def test_admin_drain_stops_a_worker_like_sigterm(env):
    from tokenrelay.protocol.keys import PARKING_CONSUMER
    from tokenrelay.worker import admin
    w1 = env.worker("w1", drain_timeout=0.5, delay=0.05)
    jobs = env.submit(prompts(2, "adm"), prefix="adm", max_tokens=200, temperature=0.0)
    wait_for(lambda: all(len(r.token_ids) >= 2 for r in env.streams(jobs).values()), 30,
             what="streaming")
    assert admin.main(["--redis-url", env.redis.url, "--namespace", env.keys.namespace,
                       "--queue", env.keys.queue, "drain", "w1"]) == 0
    assert w1.wait(15) == 0
    rows = admin.list_pending(env.r, env.keys)
    assert {(p.job_id, p.consumer, p.deliveries) for p in rows} == {
        (j, PARKING_CONSUMER, 1) for j in jobs}
    env.worker("w1", delay=0.01)                 # the flag was for its predecessor only
    reports = env.wait_ended(jobs, timeout=30)
    env.assert_exactly_once(reports)
