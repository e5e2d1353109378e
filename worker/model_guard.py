"""One model per queue: a worker whose model differs from its queue's refuses to serve.

Every worker of a queue reads the queue's jobs, so two models on one queue answer one model's
requests with the other and label them with the name asked for. A starting worker therefore
checks, right after its first heartbeat (so two workers starting together see each other),
which model its queue is served with (``protocol.heartbeat.queue_model``: that of the queue's
longest-running live worker); when that is not its own it exits 78 with one line naming both
models and the fix. Between its beat and its exit the model listing already routes nothing to
it (producer_sdk/core/models.py); and a job for another model that reaches a worker anyway (queued
before a restart with another model) ends ``invalid_request`` (worker/admission.py).
"""

from __future__ import annotations

from typing import Any, Generator, Optional, TypeVar

from tokenrelay.protocol.heartbeat import Pipeline, live_beats, queue_model
from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import EXIT_CONFIG, REDIS_ERRORS

T = TypeVar("T")


class QueueServesAnotherModel(RuntimeError):
    """The worker's queue is served with another model by a live worker that started first."""


def run_plan(client: Any, plan: Generator[Pipeline, list[Any], T]) -> T:
    """Drive a sans-IO plan of pipelined round trips on a redis-py client (blocking)."""
    try:
        commands = next(plan)
        while True:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            commands = plan.send(pipe.execute())
    except StopIteration as done:
        return done.value


def check_queue_model(client: Any, keys: Keys, worker_id: str, served: str) -> None:
    """Raise QueueServesAnotherModel when ``keys.queue`` is served with another model than
    ``served`` (call it after the worker's own first heartbeat)."""
    beats = run_plan(client, live_beats(keys.namespace, keys.queue))
    model: Optional[str] = queue_model(beats)
    if model is None or model == served:
        return
    first = sorted(w for w, b in beats.items() if b.served_model_name == model)
    raise QueueServesAnotherModel(
        f"queue {keys.queue!r} is served with model {model!r} (worker {first[0]}); this worker "
        f"({worker_id}) serves {served!r} and would answer its requests with the wrong "
        f"model: start it with its own --queue (e.g. --queue {_queue_hint(served)}), or stop "
        f"the workers of {model!r} first")


def serves_queue(client: Any, keys: Keys, worker_id: str, settings: WorkerSettings,
                 log: Any) -> bool:
    """Whether the worker may serve its queue; False after one error line (the worker exits
    78). A Redis error here skips the check with a warning: jobs still carry their model, and
    a job for another model ends ``invalid_request`` instead of being answered."""
    try:
        check_queue_model(client, keys, worker_id, settings.served_model())
    except QueueServesAnotherModel as exc:
        log.error(str(exc), exit_code=EXIT_CONFIG)
        return False
    except REDIS_ERRORS as exc:
        log.warning("could not check which model the queue is served with", error=str(exc))
    return True


def _queue_hint(served: str) -> str:
    """A queue name for ``served`` that keys can hold (no braces, colons or whitespace)."""
    hint = "".join(c if c.isalnum() or c in "-_." else "-" for c in served.split("/")[-1])
    return hint.strip("-") or "other"


__all__ = ["QueueServesAnotherModel", "check_queue_model", "serves_queue", "run_plan"]
