"""The gateway and its Redis going away: one ``tokenrelay gateway`` process started
while its Redis is down (it starts, says unhealthy, no traceback), Redis coming up (healthy,
serving), restarted (the first request after it answers succeeds: no stale pooled connection
answers an error), and down again (503 ``redis_unavailable`` with Retry-After on every
endpoint, OpenAI's shape)."""

from __future__ import annotations

import time

import httpx
import pytest

from tokenrelay.protocol.keys import Keys
from tests.fault_harness import FAST_FLAGS, wait_for
from tests.fixtures_redis import RedisServer, free_port
from tests.gateway.helpers import GatewayProcess

pytestmark = pytest.mark.timeout(120)
ENDPOINTS = [("GET", "/health"), ("GET", "/v1/models"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
BODY = {"model": "fake", "prompt": "x", "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2}


def call(gw: GatewayProcess, method: str, path: str) -> httpx.Response:
    body = dict(BODY)
    body.pop("messages" if path.endswith("/completions") and "chat" not in path else "prompt")
    return httpx.request(method, gw.url + path, json=body if method == "POST" else None,
                         timeout=30)


def assert_unavailable(gw: GatewayProcess) -> None:
    for method, path in ENDPOINTS:
        resp = call(gw, method, path)
        assert resp.status_code == 503, (path, resp.status_code, resp.text)
        assert resp.headers["retry-after"] == "1", path
        assert resp.json()["error"]["code"] == "redis_unavailable", (path, resp.text)


def test_gateway_outlives_its_redis(tmp_path, worker_process):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    gw = GatewayProcess(tmp_path / "gateway.log", "--redis-url", url, "--namespace", "out",
                        "--models-refresh-s", "0", "--status-wait-s", "0.2")
    srv = RedisServer(dir=tmp_path / "redis", port=port)
    try:
        gw.wait_up()
        assert_unavailable(gw)                  # started with Redis down: up, unhealthy
        assert gw.proc.poll() is None and "Traceback" not in gw.log(), gw.log()
        srv.start()
        wait_for(lambda: httpx.get(gw.url + "/health").status_code == 200, 10, interval=0.2,
                 what="healthy once Redis answers")
        flags = [f"--{k}={v}" for k, v in FAST_FLAGS.items()]
        worker = worker_process("--model", "fake:step_delay=0.01", "--redis-url", url,
                                "--namespace", "out", "--queue", "q", "--worker-id", "w1",
                                *flags)
        worker.wait_for_log("worker ready")
        wait_for(lambda: httpx.get(gw.url + "/v1/models").json()["data"], 15, interval=0.2,
                 what="the worker's model listed")
        for method, path in ENDPOINTS:
            assert call(gw, method, path).status_code == 200, path
        srv.restart()                           # no persistence: a fresh server, same port
        wait_for(lambda: httpx.get(gw.url + "/v1/models").json()["data"], 15, interval=0.2,
                 what="the worker's heartbeat back")
        for method, path in ENDPOINTS:          # the first request after the restart
            resp = call(gw, method, path)
            assert resp.status_code == 200, (path, resp.text)
        srv.kill()
        t0 = time.monotonic()
        assert_unavailable(gw)
        assert time.monotonic() - t0 < 20
        assert gw.proc.poll() is None and "Traceback" not in gw.log(), gw.log()
    finally:
        gw.stop()
        srv.kill()


def test_a_cancel_owed_while_redis_is_down_lands_when_it_is_back(tmp_path, worker_process):
    """A client leaves while Redis is down (killed; its AOF keeps every write): the cancel its
    disconnect owes is not swallowed; it is retried and lands once Redis is back, and the job
    (resumed by its worker) ends cancelled instead of running to its end for nobody."""
    from tokenrelay.protocol.wire import decode_event
    from tokenrelay.protocol.keys import EVENT_FIELD
    srv = RedisServer(dir=tmp_path / "redis", port=free_port(),
                      extra_args=("--appendonly", "yes", "--appendfsync", "always")).start()
    gw = GatewayProcess(tmp_path / "gateway.log", "--redis-url", srv.url, "--namespace", "out",
                        "--status-wait-s", "0.2", "--resume-grace-s", "0")
    try:
        flags = [f"--{k}={v}" for k, v in FAST_FLAGS.items()]
        worker_process("--model", "fake:step_delay=0.02", "--redis-url", srv.url,
                       "--namespace", "out", "--queue", "q", "--worker-id", "w1",
                       *flags).wait_for_log("worker ready")
        gw.wait_up()
        wait_for(lambda: httpx.get(gw.url + "/v1/models").json()["data"], 15, interval=0.2,
                 what="the worker's model listed")
        keys = Keys("out", "q")
        with httpx.stream("POST", gw.v1 + "/completions", timeout=30, json={
                "model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}) as resp:
            job_id = resp.headers["x-job-id"]
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            srv.kill()
        time.sleep(1.0)                         # the cancel is owed, Redis is down
        assert "tokenrelay_gateway_cancels_pending 1.0" in httpx.get(gw.url + "/metrics").text
        srv.start()
        r = srv.client()
        wait_for(lambda: r.exists(keys.cancel(job_id)), 20, interval=0.1,
                 what="the cancel flag, once Redis is back")

        def last() -> object:
            tail = r.xrevrange(keys.results(job_id), count=1)
            return decode_event(tail[0][1][EVENT_FIELD]) if tail else None
        wait_for(lambda: getattr(last(), "type", None) == "done", 30, what="the job ended")
        assert last().finish_reason == "cancelled" and last().usage.completion_tokens < 3000
        r.close()
    finally:
        gw.stop()
        srv.kill()
