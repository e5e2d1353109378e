"""The gateway as a hostile or careless client meets it: one ``tokenrelay gateway``
process for the module (small limits), a real redis-server and a ``--model fake:`` worker
process. Every refusal is OpenAI's error object; slow clients are cut; the in-flight limit
answers 429; a request whose model has no live worker fails fast, or, asked to wait, ends on
its own deadline with its job cancelled."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
import redis

from tokenrelay.protocol.keys import Keys
from tests.fault_harness import wait_for
from tests.gateway.helpers import sse_events, worker_and_gateway

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "hi"}]
LIMIT = 65536
IN_FLIGHT = 6


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_and_gateway(tmp_path_factory.mktemp("front-door"), "fd", "fdq",
                            "--max-body-bytes", str(LIMIT), "--header-timeout-s", "1",
                            "--body-timeout-s", "1", "--max-in-flight", str(IN_FLIGHT),
                            "--routes", "ghost=ghostq", "--models-refresh-s", "0",
                            "--keepalive-s", "0.2", "--status-wait-s", "0.2",
                            "--retry-after-s", "2", max_num_seqs=64) as pair:
        yield pair


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_bodies_paths_and_roles_refused_in_openais_shape(env):
    _, gw = env
    url = f"{gw.v1}/chat/completions"
    ok = {"model": "fake", "messages": CHAT, "max_tokens": 2}
    # a web page's no-preflight POST (text/plain, a form) is not a request
    assert error_of(httpx.post(url, content=b'{"model": "fake"}',
                               headers={"content-type": "text/plain"}), 415)["code"] == \
        "unsupported_media_type"
    assert error_of(httpx.post(url, data={"model": "fake"}), 415)
    assert error_of(httpx.post(url, content=b"{not json",
                               headers={"content-type": "application/json"}), 400)["code"] == \
        "invalid_json"
    deep = b"[" * 100_000 + b"]" * 100_000
    big = httpx.post(url, content=deep, headers={"content-type": "application/json"})
    assert error_of(big, 413)["code"] == "request_too_large"       # over 64 KiB: not read
    deep = b"[" * 20_000 + b"]" * 20_000
    assert "nested too deeply" in error_of(httpx.post(
        url, content=deep, headers={"content-type": "application/json"}), 400)["message"]

    def chunks():                   # no Content-Length: counted while it arrives
        for _ in range(40):
            yield b" " * 4096
    assert error_of(httpx.post(url, content=chunks(),
                               headers={"content-type": "application/json"}), 413)
    assert error_of(httpx.get(f"{gw.v1}/nothing-here"), 404)["code"] == "unknown_url"
    assert error_of(httpx.post(f"{gw.url}/v2/chat", json=ok), 404)
    wrong = httpx.put(url, json=ok)
    assert error_of(wrong, 405)["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"
    role = error_of(httpx.post(url, json={**ok, "messages": [{"role": "wizard",
                                                               "content": "x"}]}), 400)
    assert role["param"] == "messages[0].role"
    assert httpx.post(url, json=ok, timeout=30).status_code == 200    # and still serving


def test_slow_clients_are_cut(env):
    """Slowloris: 40 connections that dribble their headers (one line every 0.3 s) are closed
    about a second after they opened (--header-timeout-s 1), one that opens and says nothing
    too; a body that stops arriving gets 408; the gateway answers others meanwhile."""
    _, gw = env
    port = int(gw.url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(41)]
    closed_at: dict[int, float] = {}
    t0 = time.monotonic()

    def dribble(i: int, s: socket.socket) -> None:
        try:
            if i:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            s.settimeout(0.3)
            while time.monotonic() - t0 < 8:
                try:
                    if s.recv(1024) == b"":
                        break
                except socket.timeout:
                    if i:
                        s.sendall(b"X-Slow: yes\r\n")
        except OSError:
            pass
        closed_at[i] = time.monotonic() - t0

    threads = [threading.Thread(target=dribble, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200
    for t in threads:
        t.join(15)
    for s in socks:
        s.close()
    assert len(closed_at) == 41 and max(closed_at.values()) < 4, sorted(closed_at.values())
    # a body that stops arriving
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
        t1 = time.monotonic()
        reply = b""
        while b"request_timeout" not in reply and (part := s.recv(4096)):
            reply += part
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
        assert time.monotonic() - t1 < 3


def test_ids_unguessable_and_messages_for_http_callers(env):
    e, gw = env
    ids = []
    for _ in range(3):
        resp = httpx.post(f"{gw.v1}/completions", timeout=30,
                          json={"model": "fake", "prompt": "x", "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        ids.append(resp.headers["x-job-id"])
        assert resp.json()["id"] == f"cmpl-{ids[-1]}"
    assert all(len(i) >= 32 for i in ids) and len(set(ids)) == 3
    assert len(os.path.commonprefix(ids)) < 10, ids     # nothing shared but the prefix
    with e.client() as c:
        c.set_max_queued_jobs(1)
        try:
            held = c.submit("hold", max_tokens=3000)
            time.sleep(1.2)         # producers read a queue's limit at most once a second
            full = httpx.post(f"{gw.v1}/completions", timeout=30,
                              json={"model": "fake", "prompt": "x", "max_tokens": 1})
            held.cancel()
        finally:
            c.set_max_queued_jobs(0)
            time.sleep(1.2)         # read again by the gateway: no limit
    err = error_of(full, 429)
    assert err["code"] == "queue_full" and full.headers["retry-after"] == "2"
    assert "block" not in err["message"] and "max_queued_jobs" not in err["message"]


def served(gw) -> bool:
    return httpx.post(f"{gw.v1}/completions", timeout=30, json={
        "model": "fake", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_in_flight_limit_answers_429(env):
    _, gw = env
    wait_for(lambda: served(gw), 10, what="the gateway serving (the queue's limit re-read)")
    body = {"model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("POST", f"{gw.v1}/completions", json=body)
                   for _ in range(IN_FLIGHT)]
        opened = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in opened] == [200] * IN_FLIGHT
            over = httpx.post(f"{gw.v1}/completions", timeout=30,
                              json={"model": "fake", "prompt": "x", "max_tokens": 1})
            err = error_of(over, 429)
            assert err["code"] == "too_many_requests" and over.headers["retry-after"] == "2"
            assert httpx.get(f"{gw.v1}/models").status_code == 200   # only generation counts
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_for(lambda: served(gw), 10, what="room again once the streams left")


@pytest.mark.parametrize("stream", [False, True])
def test_no_live_worker_fails_fast_or_ends_on_its_deadline(env, stream):
    """``ghost`` is routed (--routes) but no worker serves it: 503 at once; asked to wait, the
    request ends 504 on its own deadline (no worker enforces it) and its job is cancelled, so
    a worker that starts later never runs it."""
    e, gw = env
    body = {"model": "ghost", "prompt": "x", "max_tokens": 2, "stream": stream}
    t0 = time.monotonic()
    fast = httpx.post(f"{gw.v1}/completions", json=body, timeout=30)
    assert error_of(fast, 503)["code"] == "no_live_worker"
    assert fast.headers["retry-after"] == "2" and time.monotonic() - t0 < 2
    t0 = time.monotonic()
    late = httpx.post(f"{gw.v1}/completions", json=body, timeout=30,
                      headers={"X-Wait-For-Worker": "true", "X-Request-Timeout": "1"})
    took = time.monotonic() - t0
    if stream:      # headers went out after --status-wait-s: the 504 is the last event
        events = list(sse_events(late.text.splitlines()))
        assert late.status_code == 200 and events[-1] == ("done", None)
        assert events[-2][1]["error"]["code"] == "expired"
    else:
        assert error_of(late, 504)["code"] == "expired"
    assert 0.9 < took < 3, took
    job_id = late.headers["x-job-id"]
    r = redis.Redis.from_url(e.url)
    keys = Keys("fd", "ghostq")
    wait_for(lambda: r.exists(keys.cancel(job_id)), 5, what="the job's cancel flag")
    assert r.exists(keys.dedupe(job_id)) and not r.exists(keys.results(job_id))
    r.close()
