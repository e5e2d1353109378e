"""The FastAPI example served by uvicorn on a free port: SSE streaming and cancel-on-disconnect."""

from __future__ import annotations

import json
import threading
from typing import Iterator

import httpx
import pytest
import redis
import uvicorn

from examples.fastapi_app import create_app
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tests.fault_harness import wait_for
from tests.sdk_helpers import FakeWorker, free_port, sdk_redis, sdk_url  # noqa: F401

KEYS = Keys()


@pytest.fixture
def base_url(sdk_url: str) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(sdk_url), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    event = "message"
    for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])
            event = "message"


def test_streams_tokens_as_sse(base_url: str, sdk_url: str):
    with FakeWorker(sdk_url):
        with httpx.stream("POST", f"{base_url}/v1/generate", timeout=20,
                          json={"prompt": "hi", "max_tokens": 4}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = list(parse_sse(resp.iter_lines()))
        assert events[0][0] == "job"
        assert "".join(d["text"] for e, d in events if e == "message") == " t0 t1 t2 t3"
        assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "length"
        plain = httpx.post(f"{base_url}/v1/generate", timeout=20,
                           json={"prompt": "x", "max_tokens": 2, "stream": False}).json()
        assert plain["text"] == " t0 t1"
        with httpx.stream("POST", f"{base_url}/v1/generate", timeout=20,
                          json={"prompt": "FAIL"}) as resp:
            failed = list(parse_sse(resp.iter_lines()))
        assert failed[-1] == ("error", {"code": "internal", "message": "fake failure"})
    bad = httpx.post(f"{base_url}/v1/generate", json={"prompt": "x", "temperature": -1})
    assert bad.status_code == 422


def test_client_disconnect_cancels_job(base_url: str, sdk_url: str):
    r = redis.Redis.from_url(sdk_url)
    with FakeWorker(sdk_url):
        with httpx.stream("POST", f"{base_url}/v1/generate", timeout=20,
                          json={"prompt": "SLOW", "max_tokens": 400}) as resp:
            events = parse_sse(resp.iter_lines())
            _, first = next(events)
            job_id = first["job_id"]
            for _ in range(3):
                next(events)
        # The response is closed: the server notices and sets the cancel flag; the worker stops.
        wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=10)
        wait_for(lambda: any(b"cancelled" in f[EVENT_FIELD]
                               for _, f in r.xrange(KEYS.results(job_id))), timeout=10)
    assert r.xlen(KEYS.results(job_id)) < 200  # 400 tokens at 50 ms each were not generated
    r.close()


def test_disconnect_while_queued_cancels_before_start(base_url: str, sdk_url: str,
                                                      start_worker):
    """A client that leaves while its job waits cancels it: the worker that reads it later
    ends it cancelled without ever giving it to the engine."""
    from tokenrelay.protocol.wire import decode_event
    from tokenrelay.worker.fake_engine import FakeEngine
    r = redis.Redis.from_url(sdk_url)
    with httpx.stream("POST", f"{base_url}/v1/generate", timeout=20,
                      json={"prompt": "nobody is serving", "max_tokens": 4}) as resp:
        _, first = next(parse_sse(resp.iter_lines()))
    job_id = first["job_id"]
    wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=10)
    engine = FakeEngine()
    start_worker(engine=engine, redis_url=sdk_url)

    def events() -> list:
        return [decode_event(f[EVENT_FIELD]) for _, f in r.xrange(KEYS.results(job_id))]

    wait_for(lambda: any(e.type in ("done", "error") for e in events()), timeout=10)
    (end,) = [e for e in events() if e.type in ("done", "error")]
    assert (end.type, end.finish_reason) == ("done", "cancelled"), end
    assert not [e for e in events() if e.type == "token"]
    assert job_id not in engine.added
    r.close()
