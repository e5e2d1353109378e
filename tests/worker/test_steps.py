"""worker/steps.py: an engine step's deltas become events; a step that raises hands the jobs
back (the ones it names counting a delivery, the others parked) and returns an
``EngineFailure``, which the loop (worker/service.py) turns into an unloaded engine in the
heartbeat, exit code 1 and a forced drain."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import GROUP, PARKING_CONSUMER
from tokenrelay.protocol.wire import DeadLetter, JobRequest
from tests.fault_harness import FaultInjectingEngine, InjectedEngineFault, read_events, submit
from tests.worker.hand_driven import KEYS, hand_worker, iterate_until  # noqa: F401
from tokenrelay.worker.entries import Entry
from tokenrelay.worker.fake_engine import FakeEngine
from tokenrelay.worker.jobs import Job, JobTable
from tokenrelay.worker.logs import get_logger
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.steps import EngineFailure, Stepper

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Stands in for the outbox and the pending list: records what the stepper asks of them."""

    def __init__(self) -> None:
        self.rejected: list = []
        self.released: list = []

    def reject(self, rejection) -> None:
        self.rejected.append(rejection)

    def release(self, keys) -> list:
        self.released += list(keys)
        return []


class Breaking(FakeEngine):
    def step(self):
        raise InjectedEngineFault(["a"])


def held(jobs: JobTable, engine: FakeEngine, job_id: str, deliveries: int = 1) -> Job:
    entry = Entry("default", "lane", f"{len(jobs) + 1}-0", {}, deliveries)
    job = Job(entry=entry, request=JobRequest(job_id=job_id, prompt="p"), owner="w1:t",
              worker_id="w1", in_engine=True)
    engine.add_request(job_id, "p", job.request.sampling_params())
    jobs[job_id] = job
    return job


@pytest.mark.parametrize("deliveries,max_deliveries", [(1, 3), (3, 3)])
def test_a_failed_step_hands_back_the_named_jobs_and_parks_the_others(deliveries,
                                                                     max_deliveries):
    engine, log = Breaking(), get_logger(worker_id="w1")
    jobs, rec = JobTable(engine, WorkerMetrics(), log), Recorder()
    a, b = held(jobs, engine, "a", deliveries), held(jobs, engine, "b")
    stepper = Stepper(engine, jobs, rec, rec, max_deliveries, WorkerMetrics(), log)
    failure = stepper.step()
    assert isinstance(failure, EngineFailure) and isinstance(failure.error, InjectedEngineFault)
    assert not engine.has_unfinished_requests() and not a.in_engine and not b.in_engine
    assert "a" not in jobs and jobs["b"] is b and b.parking       # b: no delivery counted
    if deliveries < max_deliveries:
        assert rec.released == [a.entry.key] and rec.rejected == []
    else:                                                         # its last allowed delivery
        assert rec.released == [] and [r.code for r in rec.rejected] == ["poison"]


def test_a_step_that_runs_reports_no_failure_and_queues_events():
    engine, log = FakeEngine(), get_logger(worker_id="w1")
    jobs = JobTable(engine, WorkerMetrics(), log)
    job = held(jobs, engine, "a")
    stepper = Stepper(engine, jobs, Recorder(), Recorder(), 3, WorkerMetrics(), log)
    assert stepper.step() is None and job.pending and job.tokens == 1
    stepper.account()


def test_the_loop_turns_a_failed_step_into_exit_1_and_an_unloaded_engine(hand_worker,
                                                                         redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FaultInjectingEngine(FakeEngine(), "boom"), max_deliveries=1)
    poison = submit(r, KEYS, {"job_id": "poison", "prompt": "boom", "params": {"max_tokens": 5}})
    fine = submit(r, KEYS, {"job_id": "fine", "prompt": "ok", "params": {"max_tokens": 50}})
    iterate_until(w, lambda: w.stopping)
    assert (w.exit_code, w.engine_broken, w.status().engine_loaded) == (1, True, False)
    w._crew().liveness.heartbeat()
    assert Heartbeat.decode(r.hgetall(KEYS.heartbeat("w1"))).engine_loaded is False
    iterate_until(w, lambda: not w.jobs)          # the forced drain hands back what is held
    assert w._iteration() is True                 # ... and then says exit
    (letter,) = [DeadLetter.from_fields(f) for _, f in r.xrange(KEYS.dead())]
    assert (letter.job_id, letter.code, letter.entry_id) == ("poison", "poison", poison)
    assert [e.type for e in read_events(r, KEYS, "poison")][-1] == "error"
    rows = {x["message_id"].decode(): x for x in
            r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10)}
    assert list(rows) == [fine] and rows[fine]["consumer"].decode() == PARKING_CONSUMER
    assert rows[fine]["times_delivered"] == 1                     # parked: nothing counted
