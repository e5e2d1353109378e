"""worker/cycle.py and worker/writer.py: the flush of step N runs on the writer's thread while
the loop's thread runs step N+1. The bound (one flush in flight, awaited before the next step:
a slow Redis holds the engine back), aborts deferred to the step's end, errors of the flush
raised in the loop's thread, and the serial loop kept for a worker nobody opened a writer for.
(The worker's promises under the overlapped loop: tests/worker/test_service.py, whose workers
run it; a SIGKILL at each point of it: tests/faults/test_pipeline_kills.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from tests.fault_harness import check_stream, submit, wait_for
from tests.worker.hand_driven import KEYS, hand_worker, iterate_until, start_job  # noqa: F401
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion
from tokenrelay.worker.jobs import JobTable
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.writer import Writer, WriterBusy
from tests.worker.test_steps import held

pytestmark = pytest.mark.timeout(60)


class Log:
    def __getattr__(self, name):
        return lambda *a, **k: None


def test_the_writer_runs_one_job_at_a_time_and_raises_its_error_in_the_caller():
    w: Writer[int] = Writer("t")
    w.open()
    try:
        seen = []
        w.start(lambda: seen.append(threading.current_thread().name) or 7)
        with pytest.raises(WriterBusy):
            w.start(lambda: 8)
        assert w.wait() == 7 and seen == ["t"]
        w.start(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            w.wait()
        w.start(lambda: 9)                # usable again after a failed job
        assert w.wait() == 9
    finally:
        w.close()
    assert not w.running


def test_aborts_during_a_step_reach_the_engine_when_it_is_over():
    eng = FakeEngine()
    jobs = JobTable(eng, WorkerMetrics(), Log())
    job = held(jobs, eng, "c")
    with jobs.stepping():
        jobs.cancel(job, "cancel flag")
        assert not job.in_engine and eng.aborted == []   # the table no longer runs it ...
    assert eng.aborted == ["c"]                            # ... the engine hears at the end
    assert job.terminal == "done" and job.finish_reason == "cancelled"


def test_a_slow_redis_holds_the_engine_back_one_step_in_flight(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine(step_delay=0.005))
    w.writer.open()
    start_job(w, r, "j", 60)
    steps = w.engine.num_steps
    r.client_pause(400, all=False)        # writes wait 0.4 s: the flush in flight with them
    t0 = time.monotonic()
    w._iteration()
    assert time.monotonic() - t0 > 0.3    # the loop waited for the flush ...
    assert w.engine.num_steps == steps + 1   # ... after one step, not running ahead
    iterate_until(w, lambda: check_stream(r, KEYS, "j").ended)
    rep = check_stream(r, KEYS, "j")
    assert rep.problems == [] and rep.text == fake_completion("j", 60)


def test_a_connection_lost_under_the_overlap_keeps_the_step_and_retries(hand_worker,
                                                                          redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine(step_delay=0.005))
    w.writer.open()
    start_job(w, r, "k", 30)
    lost = []

    def drop_connection(point: str) -> None:   # the flush in flight loses its connection
        if point == "built" and not lost:
            lost.append(point)
            raise redis.ConnectionError("connection lost under the overlap")
    w._crew().outbox.fault_point = drop_connection
    job = w.jobs["k"]
    steps = w.engine.num_steps
    assert w._iteration_guarded() is False    # raised in the loop's thread, after the step
    assert lost and w.engine.num_steps == steps + 1
    assert w._crew().stepper.owes() and job.pending   # nothing built or stepped is lost
    iterate_until(w, lambda: check_stream(r, KEYS, "k").ended)
    rep = check_stream(r, KEYS, "k")
    assert rep.problems == [] and rep.text == fake_completion("k", 30)


def test_the_overlapped_worker_streams_every_job_exactly(start_worker, redis_server):
    r = redis_server.client()
    eng = FakeEngine(max_num_seqs=16, step_delay=0.003)
    w = start_worker(engine=eng).worker
    assert w.writer.running
    for i in range(16):
        submit(r, KEYS, {"job_id": f"o{i}", "prompt": f"o{i}", "stream": True,
                         "params": {"max_tokens": 25 + i, "temperature": 0}})
    wait_for(lambda: all(check_stream(r, KEYS, f"o{i}").ended for i in range(16)), 30,
             what="every job ended")
    for i in range(16):
        rep = check_stream(r, KEYS, f"o{i}")
        assert rep.problems == [] and rep.text == fake_completion(f"o{i}", 25 + i)


def test_a_job_resumed_under_the_overlap_never_takes_its_old_runs_deltas(hand_worker,
                                                                         redis_server):
    """The flush that finds a stream shorter than written (BEHIND: a failover lost events)
    drops the job while the next step runs it; the loop admits it again under the same id.
    That step's deltas belong to the old run: built into the new job they would put a token
    at the wrong position."""
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine())
    w.writer.open()
    submit(r, KEYS, {"job_id": "lost", "prompt": "lost", "params": {"max_tokens": 30,
                                                                   "temperature": 0}})
    iterate_until(w, lambda: "lost" in w.jobs and w.jobs["lost"].tokens >= 5)
    stream = KEYS.results("lost")
    r.xdel(stream, r.xrevrange(stream, count=1)[0][0])   # a failover lost the last write
    old = w.jobs["lost"]
    iterate_until(w, lambda: w.jobs.get("lost") not in (None, old))   # dropped, admitted again
    iterate_until(w, lambda: check_stream(r, KEYS, "lost").ended)
    rep = check_stream(r, KEYS, "lost")
    assert rep.problems == [] and rep.text == fake_completion("lost", 30)
    assert [s.attempt for s in rep.started] == [1, 2]


@pytest.mark.parametrize("flag,device,expected", [
    (None, None, True),          # the fake engine (no config): a simulated GPU, overlapped
    (None, "cuda:1", True), (None, "cpu", False),
    (True, "cpu", True), (False, "cuda", False)])    # the flag wins
def test_the_overlap_is_on_unless_the_engine_steps_on_the_cpu(flag, device, expected):
    from types import SimpleNamespace

    from tokenrelay.worker.config import WorkerSettings
    from tokenrelay.worker.service import overlaps
    settings = WorkerSettings(model="fake:", overlap_steps=flag)
    engine = FakeEngine() if device is None else SimpleNamespace(
        config=SimpleNamespace(device=device))
    assert overlaps(settings, engine) is expected
