"""Test helpers for the producer SDK: a private redis-server and a fake worker thread.

The fake worker follows protocol v1 closely enough to exercise every SDK path (consumer group
reads, started/token/done/error events, cancel flags, a crash-and-resume that re-emits tokens)
without torch or a model, so SDK tests run in seconds.

Prompt directives understood by the fake worker:
  ``FAIL``     -> terminal error event (code internal)
  ``CRASH``    -> after 3 tokens, a second ``started`` (attempt 2) and tokens 1..2 re-emitted
  ``SLOW``     -> 50 ms per token regardless of the worker's token_delay
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import msgpack
import pytest
import redis

from tokenrelay.protocol.keys import EVENT_FIELD, GROUP, Keys, PAYLOAD_FIELD
from tokenrelay.protocol.wire import decode_job
from tokenrelay.protocol.topology import make_client
from tests.fixtures_redis import RedisServer, free_port, start_redis_server

__all__ = ["RedisServer", "free_port", "start_redis_server", "sdk_redis", "sdk_url", "FakeWorker",
           "env_with_repo"]


@pytest.fixture(scope="module")
def sdk_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server per test module (starting one per test costs more than tests)."""
    server = start_redis_server(tmp_path_factory.mktemp("sdk-redis"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def sdk_url(sdk_redis: RedisServer) -> Iterator[str]:
    """URL of the module's server with an empty database for each test."""
    admin = sdk_redis.client()
    admin.flushall()
    yield sdk_redis.url
    admin.flushall()
    admin.close()


class FakeWorker(threading.Thread):
    """Reads jobs from the consumer group and writes protocol v1 result events. On a queue of
    several ``shards`` it reads each shard's lanes in turn (one slot each, so it also runs
    against a Redis Cluster, whose client ``topology.make_client`` makes) and writes a job's
    events with the keys of the shard it read the job from."""

    def __init__(self, url: str, namespace: str = "tokenrelay", queue: str = "default", *,
                 token_delay: float = 0.0, worker_id: str = "fake-1", result_ttl_s: int = 3600,
                 start_delay: float = 0.0, shards: int = 1) -> None:
        super().__init__(daemon=True, name=f"fake-worker-{worker_id}")
        self.r = make_client(url)
        self.keys = Keys(namespace, queue, shards)
        self.token_delay = token_delay
        self.worker_id = worker_id
        self.ttl = result_ttl_s
        self.start_delay = start_delay
        self.shard = 0
        self.stopping = threading.Event()
        self.processed: list[str] = []
        self.max_depth_seen = 0
        self.errors: list[BaseException] = []

    # -- lifecycle
    def __enter__(self) -> "FakeWorker":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        self.r.close()
        if self.errors:
            raise self.errors[0]

    def run(self) -> None:
        try:
            self._setup()
            if self.start_delay:
                time.sleep(self.start_delay)
            while not self.stopping.is_set():
                self._step()
        except BaseException as exc:  # surfaced by stop()
            if not self.stopping.is_set():
                self.errors.append(exc)

    def _setup(self) -> None:
        self._beat()
        for lane in self.keys.lanes():
            with contextlib.suppress(redis.ResponseError):  # BUSYGROUP
                self.r.xgroup_create(lane, GROUP, id="0", mkstream=True)

    def _beat(self) -> None:
        """Registry entry and the heartbeat fields that make a worker live for its queue (what
        ``Client.live_workers`` and the CLI's submit read); no served model name, so model
        routing (the batch runner) sees no model."""
        self.r.zadd(self.keys.workers, {self.worker_id: int(time.time() * 1000)})
        beat = self.keys.heartbeat(self.worker_id)
        self.r.hset(beat, mapping={"queue": self.keys.queue, "engine_loaded": "1",
                                   "draining": "0"})
        self.r.pexpire(beat, 2000)

    def _step(self) -> None:
        self._beat()
        depth = sum(self.r.xlen(k) for k in self.keys.lanes())
        self.max_depth_seen = max(self.max_depth_seen, depth)
        block = 50 if self.keys.shards == 1 else None
        found = False
        for shard in range(self.keys.shards):
            reply = self.r.xreadgroup(GROUP, self.worker_id,
                                      {k: ">" for k in self.keys.lanes(shard)}, count=1,
                                      block=block)
            for lane, entries in reply or []:
                for entry_id, fields in entries:
                    found = True
                    self._run_job(fields[PAYLOAD_FIELD], shard)
                    self.r.xack(lane, GROUP, entry_id)
                    self.r.xdel(lane, entry_id)
        if not found and block is None:
            time.sleep(0.01)

    # -- one job
    def _emit(self, job_id: str, event: dict[str, Any]) -> None:
        key = self.keys.results(job_id, self.shard)
        event.setdefault("ts", time.time())
        self.r.xadd(key, {EVENT_FIELD: msgpack.packb(event, use_bin_type=True)})
        self.r.expire(key, self.ttl)

    def _cancelled(self, job_id: str) -> bool:
        return bool(self.r.exists(self.keys.cancel(job_id, self.shard)))

    def _run_job(self, raw: bytes, shard: int = 0) -> None:
        job = decode_job(raw)
        self.shard = shard          # the shard the job was read from: its keys are there
        self.processed.append(job.job_id)
        if self._cancelled(job.job_id):
            self._emit(job.job_id, {"type": "done", "finish_reason": "cancelled"})
            return
        self._emit(job.job_id, {"type": "started", "worker_id": self.worker_id, "attempt": 1,
                                "seed": 1234})
        prompt = job.prompt or " ".join(m.content for m in job.messages or []) or "ids"
        if "FAIL" in prompt:
            self._emit(job.job_id, {"type": "error", "code": "internal",
                                    "message": "fake failure"})
            return
        self._generate(job, prompt)

    def _generate(self, job: Any, prompt: str) -> None:
        max_tokens = int(job.params.get("max_tokens", 16))
        delay = 0.05 if "SLOW" in prompt else self.token_delay
        texts, ids, reason = [], [], "length"
        seq = 0
        i = 0
        while i < max_tokens:
            if self._cancelled(job.job_id):
                reason = "cancelled"
                break
            if delay:
                time.sleep(delay)
            text, tid = f" t{i}", 100 + i
            texts.append(text)
            ids.append(tid)
            if job.stream:
                lp = [{tid: -0.5}] if job.params.get("logprobs") is not None else None
                ev = {"type": "token", "seq": seq, "choice": 0, "position": i, "text": text,
                      "token_ids": [tid]}
                if lp:
                    ev["logprobs"] = lp
                self._emit(job.job_id, ev)
            seq += 1
            i += 1
            if "CRASH" in prompt and i == 3 and job.stream:
                self._resume(job.job_id)
        done: dict[str, Any] = {"type": "done", "finish_reason": reason,
                                "usage": {"prompt_tokens": len(prompt.split()),
                                          "completion_tokens": len(ids)},
                                "timings": {"queued_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0},
                                "metadata": job.metadata}
        if not job.stream:
            done["text"] = "".join(texts)
            done["token_ids"] = ids
        self._emit(job.job_id, done)

    def _resume(self, job_id: str) -> None:
        """Pretend this worker crashed after 3 tokens and a second one resumed the job."""
        self._emit(job_id, {"type": "started", "worker_id": self.worker_id + "-b", "attempt": 2,
                            "seed": 1234, "resumed_tokens": 2})
        for j in (1, 2):  # a resume that overlaps what was already streamed
            self._emit(job_id, {"type": "token", "seq": j, "choice": 0, "position": j,
                                "text": f" t{j}", "token_ids": [100 + j]})


def env_with_repo(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment for subprocesses that import the repo's packages."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class RealWorker:
    """A ``worker.service.Worker`` thread on a shared real engine (one engine per test module:
    building it costs seconds). ``stop()`` also aborts what the engine still holds, so the next
    test starts from an idle engine."""

    def __init__(self, url: str, engine: Any, worker_id: str = "sdk-real", *,
                 model: str = "unused", served_model_name: Optional[str] = None) -> None:
        from tokenrelay.worker.config import WorkerSettings
        from tokenrelay.worker.service import Worker
        settings = WorkerSettings(redis_url=url, worker_id=worker_id, model=model,
                                  served_model_name=served_model_name,
                                  block_ms=50, heartbeat_ms=200, drain_timeout=0.0)
        self.engine = engine
        self.worker = Worker(settings, engine=engine)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def start(self) -> "RealWorker":
        self.thread.start()
        assert self.worker.ready.wait(60), "worker did not become ready"
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.worker.stop(force=True)
            self.thread.join(30)
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
