"""Resumable SSE streams (issue #40): every event has an id, a client that lost its connection
resumes with ``Last-Event-ID`` on the same gateway or another one and gets exactly the rest
(compared event by event with an uninterrupted run and with a replay of the same job), a
client that does not come back within ``--resume-grace-s`` has its job cancelled (the worker
sees it), another API key is refused, bad ids are 400. A real redis-server per test, a
``--model fake:`` worker whose output is a known function of the prompt."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

import httpx
import pytest
import redis

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import Keys, stream_session_key
from tests.fault_harness import wait_for
from tests.gateway.helpers import GatewayProcess, chunk_texts, strict_chunks, sse_events
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

pytestmark = pytest.mark.timeout(120)
KEYS = Keys()
MODEL = "fake"
CHAT = [{"role": "user", "content": "Tell a long story."}]
Event = tuple[Optional[str], str]           # (id, data)


def chat_body(**extra: Any) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 30, "stream": True, "seed": 7,
            "temperature": 0.7, "n": 2, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}, **extra}


def completion_body(**extra: Any) -> dict:
    return {"model": MODEL, "prompt": "resume me", "max_tokens": 30, "stream": True,
            "temperature": 0, "logprobs": 2, **extra}


def events_of(lines: Any) -> list[Event]:
    """Each SSE event as (its id, its data); comments are not events."""
    out: list[Event] = []
    event_id: Optional[str] = None
    data: Optional[str] = None
    for line in lines:
        if line == "":
            if data is not None:
                out.append((event_id, data))
            event_id = data = None
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
    if data is not None:
        out.append((event_id, data))
    return out


def read_some(url: str, body: Optional[dict], count: int, headers: Optional[dict] = None
              ) -> tuple[str, list[Event]]:
    """Open a stream, read ``count`` events and drop the connection: (job id, events)."""
    method = "POST" if body is not None else "GET"
    with httpx.stream(method, url, json=body, headers=headers or {}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        got: list[Event] = []
        event_id: Optional[str] = None
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                got.append((event_id, line[6:]))
                event_id = None
                if len(got) == count:
                    break
        return resp.headers["x-job-id"], got


def read_all(url: str, body: Optional[dict], headers: Optional[dict] = None
             ) -> tuple[httpx.Response, list[Event]]:
    method = "POST" if body is not None else "GET"
    with httpx.stream(method, url, json=body, headers=headers or {}, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, []
        return resp, events_of(resp.iter_lines())


def normalized(events: list[Event]) -> list[tuple[str, Any]]:
    """Events without what names their job (ids, ``created``): two jobs of one request
    compare equal when everything else is."""
    out = []
    for event_id, data in events:
        assert event_id is not None, f"event without an id: {data[:80]}"
        place = event_id.split(":", 1)[1]
        obj = None if data == "[DONE]" else json.loads(data)
        if isinstance(obj, dict) and "created" in obj:
            obj = {k: v for k, v in obj.items() if k not in ("id", "created")}
        out.append((place, obj))
    return out


def error_code(resp: httpx.Response) -> str:
    return resp.json()["error"]["code"]


@pytest.fixture
def slow_worker(start_worker):
    return start_worker(engine=FakeEngine(step_delay=0.05))


@pytest.fixture
def gw(redis_server, slow_worker, gateway_factory):
    return gateway_factory(redis_server.url, resume_grace_s=10.0)


def test_every_event_has_an_id_that_grows_along_the_stream(gw):
    resp, events = read_all(f"{gw.v1}/chat/completions", chat_body(max_tokens=5))
    job_id = resp.headers["x-job-id"]
    assert events[-1][1] == "[DONE]" and len(events) > 10
    places = []
    for event_id, _ in events:
        job, t, k = event_id.split(":")
        assert job == job_id
        places.append((int(t), int(k)))
    assert places == sorted(set(places)), "ids repeat or go back"
    chunks = strict_chunks(True, [("done", None) if d == "[DONE]" else ("data", json.loads(d))
                                  for _, d in events])
    assert chunk_texts(True, chunks) == {
        i: fake_completion(FakeEngine().render_chat(CHAT), 5, seed=7, greedy=False, choice=i)
        for i in range(2)}


@pytest.mark.parametrize("cut", [1, 2, 7, -2, -1])
def test_resume_on_the_same_gateway_gives_exactly_the_rest(gw, redis_server, cut):
    """Cut after the first event (the role chunk), inside a delta's events, later, before
    the usage chunk and before ``[DONE]``: the two parts together are the uninterrupted
    stream, event for event, and exactly a replay of the same job."""
    url = f"{gw.v1}/chat/completions"
    _, whole = read_all(url, chat_body())
    cut = cut if cut > 0 else len(whole) + cut
    job_id, first = read_some(url, chat_body(), cut)
    resp, rest = read_all(url, chat_body(), {"Last-Event-ID": first[-1][0]})
    assert resp.status_code == 200 and resp.headers["x-job-id"] == job_id
    assert normalized(first + rest) == normalized(whole)
    _, replay = read_all(f"{gw.v1}/streams/{job_id}", None)
    assert first + rest == replay        # same chunk ids, created, model: byte for byte
    with Client(redis_server.url) as c:
        assert c.get(job_id).result(timeout=20).finish_reason == "length"
    assert not redis.Redis.from_url(redis_server.url).exists(KEYS.cancel(job_id))


def test_resume_through_a_second_gateway_process(gw, redis_server, tmp_path):
    """The reconnect lands on another gateway (a separate process on the same Redis): it
    rebuilds the logprob offsets from the result stream and sends the rest only."""
    other = GatewayProcess(tmp_path / "gw2.log", "--redis-url", redis_server.url,
                           "--models-refresh-s", "0", "--keepalive-s", "0.2",
                           "--status-wait-s", "0.2", "--resume-grace-s", "10")
    try:
        other.wait_up()
        url = f"{gw.v1}/completions"
        _, whole = read_all(url, completion_body())
        job_id, first = read_some(url, completion_body(), 6)
        resp, rest = read_all(f"{other.v1}/completions", completion_body(),
                              {"Last-Event-ID": first[-1][0]})
        assert resp.status_code == 200, resp.text
        assert normalized(first + rest) == normalized(whole)
        texts = [json.loads(d)["choices"][0]["text"] for _, d in first + rest
                 if d != "[DONE]" and json.loads(d)["choices"]]
        assert "".join(texts) == fake_completion("resume me", 30)
        offsets = [o for _, d in first + rest if d != "[DONE]"
                   for ch in json.loads(d)["choices"] if ch["logprobs"]
                   for o in ch["logprobs"]["text_offset"]]
        assert offsets == list(range(30))
    finally:
        other.stop()


def test_a_job_nobody_resumes_within_the_grace_is_cancelled(redis_server, slow_worker,
                                                             gateway_factory):
    gw = gateway_factory(redis_server.url, resume_grace_s=0.8)
    r = redis.Redis.from_url(redis_server.url)
    body = chat_body(max_tokens=3000, n=1)
    job_id, first = read_some(f"{gw.v1}/chat/completions", body, 3)
    left = time.monotonic()
    wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=10, what="the cancel flag")
    assert time.monotonic() - left >= 0.7, "cancelled before its grace ran out"
    with Client(redis_server.url) as c:
        result = c.get(job_id).result(timeout=20)
    assert result.finish_reason == "cancelled" and result.usage.completion_tokens < 3000
    resp, _ = read_all(f"{gw.v1}/chat/completions", body, {"Last-Event-ID": first[-1][0]})
    assert resp.status_code == 410 and error_code(resp) == "stream_cancelled"
    assert "--resume-grace-s" in resp.json()["error"]["message"]


def test_a_job_parked_by_a_gateway_that_died_is_cancelled_by_another(
        redis_server, slow_worker, gateway_factory, tmp_path):
    gateway_factory(redis_server.url, resume_grace_s=1.0)      # the survivor, sweeping
    dying = GatewayProcess(tmp_path / "dying.log", "--redis-url", redis_server.url,
                           "--models-refresh-s", "0", "--resume-grace-s", "1")
    r = redis.Redis.from_url(redis_server.url)
    try:
        dying.wait_up()
        job_id, _ = read_some(f"{dying.v1}/chat/completions", chat_body(max_tokens=3000), 3)
        key = stream_session_key("tokenrelay", job_id)
        wait_for(lambda: r.hget(key, "state") == b"parked", timeout=10, what="parked")
        dying.proc.kill()
        dying.proc.wait(10)
    finally:
        dying.stop()
    wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=10, what="the cancel flag")
    assert r.hget(key, "state") == b"cancelled"
    with Client(redis_server.url) as c:
        assert c.get(job_id).result(timeout=20).finish_reason == "cancelled"


def test_grace_zero_cancels_at_once(redis_server, slow_worker, gateway_factory):
    gw = gateway_factory(redis_server.url, resume_grace_s=0)
    r = redis.Redis.from_url(redis_server.url)
    body = chat_body(max_tokens=3000, n=1)
    job_id, first = read_some(f"{gw.v1}/chat/completions", body, 3)
    wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=5, what="the cancel flag")
    wait_for(lambda: r.hget(stream_session_key("tokenrelay", job_id), "state") == b"parked",
             timeout=5, what="the record")
    resp, _ = read_all(f"{gw.v1}/chat/completions", body, {"Last-Event-ID": first[-1][0]})
    assert resp.status_code == 410 and error_code(resp) == "stream_cancelled"


def test_only_the_key_that_started_a_job_resumes_it(redis_server, slow_worker,
                                                   gateway_factory):
    gw = gateway_factory(redis_server.url, resume_grace_s=10.0, api_keys=["key-a", "key-b"])
    url = f"{gw.v1}/completions"
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    job_id, first = read_some(url, completion_body(), 4, headers=a)
    last = {"Last-Event-ID": first[-1][0]}
    resp, _ = read_all(url, completion_body(), {**b, **last})
    assert resp.status_code == 403 and error_code(resp) == "stream_forbidden"
    resp, _ = read_all(f"{gw.v1}/streams/{job_id}", None, {**b, **last})
    assert resp.status_code == 403
    resp, _ = read_all(f"{gw.v1}/streams/{job_id}", None, last)
    assert resp.status_code == 401
    resp, rest = read_all(f"{gw.v1}/streams/{job_id}", None, {**a, **last})
    assert resp.status_code == 200
    texts = [json.loads(d)["choices"][0]["text"] for _, d in first + rest if d != "[DONE]"]
    assert "".join(texts) == fake_completion("resume me", 30)


def test_bad_last_event_ids_are_400_and_unknown_streams_404(gw):
    url = f"{gw.v1}/completions"
    resp, _ = read_all(url, completion_body(), {"Last-Event-ID": "not-an-id"})
    assert resp.status_code == 400 and error_code(resp) == "invalid_last_event_id"
    assert resp.json()["error"]["param"] == "Last-Event-ID"
    unknown = "gw-" + "0" * 32
    resp, _ = read_all(url, completion_body(), {"Last-Event-ID": f"{unknown}:3:0"})
    assert resp.status_code == 404 and error_code(resp) == "stream_not_found"
    resp, _ = read_all(f"{gw.v1}/streams/nope", None)
    assert resp.status_code == 404 and error_code(resp) == "stream_not_found"
    resp, whole = read_all(url, completion_body(max_tokens=4))
    job_id = resp.headers["x-job-id"]
    for bad in (f"{job_id}:99:0", f"{job_id}:2:7"):         # past the end; no such event
        resp, _ = read_all(url, completion_body(max_tokens=4), {"Last-Event-ID": bad})
        assert resp.status_code == 400 and error_code(resp) == "invalid_last_event_id", bad
    resp, _ = read_all(url, completion_body(max_tokens=5), {"Last-Event-ID": whole[1][0]})
    assert resp.status_code == 400 and error_code(resp) == "stream_mismatch"
    resp, _ = read_all(f"{gw.v1}/streams/{unknown}", None, {"Last-Event-ID": whole[1][0]})
    assert resp.status_code == 400 and error_code(resp) == "invalid_last_event_id"
    resp, rest = read_all(url, completion_body(max_tokens=4), {"Last-Event-ID": whole[1][0]})
    assert resp.status_code == 200 and rest == whole[2:]    # a finished job resumes too


def test_a_trimmed_result_stream_is_410(gw, redis_server):
    url = f"{gw.v1}/completions"
    resp, whole = read_all(url, completion_body(max_tokens=6))
    job_id = resp.headers["x-job-id"]
    r = redis.Redis.from_url(redis_server.url)
    results = KEYS.results(job_id)
    entries = r.xrange(results)
    r.xdel(results, entries[1][0])                         # a token event before the cut
    resp, _ = read_all(url, completion_body(max_tokens=6), {"Last-Event-ID": whole[4][0]})
    assert resp.status_code == 410 and error_code(resp) == "stream_gone"
    r.delete(results, KEYS.dedupe(job_id))                 # everything expired
    resp, _ = read_all(url, completion_body(max_tokens=6), {"Last-Event-ID": whole[4][0]})
    assert resp.status_code == 410 and error_code(resp) == "stream_gone"


def test_two_clients_resuming_at_once_the_newest_wins(gw):
    """The older connection ends with a ``stream_taken_over`` error (carrying the id of the
    last event it got: its Last-Event-ID stays on the job's events); the newer one gets
    exactly the rest."""
    url = f"{gw.v1}/completions"
    body = completion_body(max_tokens=120, logprobs=None)
    job_id, first = read_some(url, body, 3)
    last = {"Last-Event-ID": first[-1][0]}
    older: dict[str, Any] = {}

    def hold() -> None:
        with httpx.stream("POST", url, json=body, headers=last, timeout=30) as resp:
            older["status"] = resp.status_code
            older["events"] = events_of(resp.iter_lines())
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    wait_for(lambda: "status" in older, timeout=10, what="the older resume")
    resp, rest = read_all(url, body, last)
    t.join(30)
    assert not t.is_alive()
    assert resp.status_code == 200
    texts = [json.loads(d)["choices"][0]["text"] for _, d in first + rest if d != "[DONE]"]
    assert "".join(texts) == fake_completion("resume me", 120)
    *got, error, done = older["events"]
    last_id = got[-1][0] if got else first[-1][0]
    assert error[0] == last_id and json.loads(error[1])["error"]["code"] == "stream_taken_over"
    assert done == (last_id, "[DONE]")
    assert len(older["events"]) < len(rest)


def test_the_openai_style_retry_without_a_worker_answer_yet(redis_server, gateway_factory,
                                                            start_worker):
    """A client that left before the first token (its job still queued: no worker yet)
    resumes by id from the start and gets the whole stream once a worker comes."""
    gw = gateway_factory(redis_server.url, resume_grace_s=10.0, routes=["fake=default"],
                         wait_for_worker=True)
    with httpx.stream("POST", f"{gw.v1}/completions", json=completion_body(max_tokens=5),
                      timeout=30) as resp:
        job_id = resp.headers["x-job-id"]
        kinds = [k for k, _ in sse_events(iter([next(resp.iter_lines())]))]
        assert kinds == ["comment"]
    start_worker()
    resp, events = read_all(f"{gw.v1}/streams/{job_id}", None)
    assert resp.status_code == 200
    texts = [json.loads(d)["choices"][0]["text"] for _, d in events if d != "[DONE]"]
    assert "".join(texts) == fake_completion("resume me", 5)


def test_a_gateway_under_the_producer_acl_role_resumes(redis_server, slow_worker,
                                                       gateway_factory):
    """docs/operations.md's producer rule covers what resumable streams send (records, the
    scripts' TIME, the parked set): a gateway logged in as that user parks and resumes."""
    from tests.faults.test_security import acl_rule
    r = redis.Redis.from_url(redis_server.url)
    r.execute_command("ACL", "SETUSER", "gw", *acl_rule("producer", "tokenrelay", "pw").split())
    url = redis_server.url.replace("redis://", "redis://gw:pw@", 1)
    gw = gateway_factory(url, resume_grace_s=10.0)
    job_id, first = read_some(f"{gw.v1}/completions", completion_body(), 5)
    wait_for(lambda: r.hget(stream_session_key("tokenrelay", job_id), "state") == b"parked",
             timeout=10, what="parked")
    resp, rest = read_all(f"{gw.v1}/completions", completion_body(),
                          {"Last-Event-ID": first[-1][0]})
    assert resp.status_code == 200, resp.text
    texts = [json.loads(d)["choices"][0]["text"] for _, d in first + rest if d != "[DONE]"]
    assert "".join(texts) == fake_completion("resume me", 30)
    assert [e for e in r.acl_log() if e.get("username") == "gw"] == []


def test_resume_on_another_gateway_after_the_worker_died(tmp_path, gateway_factory):
    """The client drops its connection, the worker serving the job is SIGKILLed, another
    worker takes the job over while the client resumes on a second gateway process: the
    resumed stream is exactly the rest (the fold skips what the new worker re-emits)."""
    from tests.fault_harness import FaultEnv
    env = FaultEnv(tmp_path)
    other = None
    try:
        env.worker("w1", delay=0.05)
        ns = env.keys.namespace
        gw = gateway_factory(env.redis.url, namespace=ns, resume_grace_s=30.0)
        other = GatewayProcess(tmp_path / "gw2.log", "--redis-url", env.redis.url,
                               "--namespace", ns, "--models-refresh-s", "0",
                               "--keepalive-s", "0.2", "--status-wait-s", "0.2",
                               "--resume-grace-s", "30").wait_up()
        body = completion_body(max_tokens=60, n=2, seed=21, temperature=1.0, logprobs=None,
                               stream_options={"include_usage": True})
        job_id, first = read_some(f"{gw.v1}/completions", body, 12)
        assert env.held_by("w1"), "the job is not held by w1"
        env.workers[0].kill()
        env.worker("w2", delay=0.01)
        resp, rest = read_all(f"{other.v1}/completions", body, {"Last-Event-ID": first[-1][0]})
        assert resp.status_code == 200, resp.text
        got: dict[int, str] = {}
        for _, data in first + rest:
            if data != "[DONE]":
                for ch in json.loads(data)["choices"]:
                    got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
        assert got == {i: fake_completion("resume me", 60, seed=21, greedy=False, choice=i)
                       for i in range(2)}
        assert json.loads(rest[-2][1])["usage"]["completion_tokens"] == 120
        (report,) = env.streams([job_id]).values()
        assert len(report.started) >= 2, "the job was not taken over"
        _, replay = read_all(f"{other.v1}/streams/{job_id}", None)
        assert first + rest == replay
    finally:
        if other is not None:
            other.stop()
        env.close()


@pytest.mark.parametrize("cut", [2, 5, 9])
def test_a_resumed_tool_call_stream_keeps_the_calls_ids_and_fragments(gw, cut):
    """A forced tool call (the call reader's state, the call ids derived from the job) cut
    at the role chunk, the call's first delta and amid its arguments: the parts together
    are exactly a replay of the job, and hold the calls of an uninterrupted run."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["city"],
            "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 12}}}}}
    body = {"model": MODEL, "messages": CHAT, "tools": [weather], "tool_choice": "required",
            "max_tokens": 200, "temperature": 1.0, "seed": 11, "stream": True}
    url = f"{gw.v1}/chat/completions"

    def calls(events: list[Event]) -> list[tuple[Any, ...]]:
        found: dict[int, list] = {}
        for _, data in events:
            for ch in ([] if data == "[DONE]" else json.loads(data)["choices"]):
                for d in ch["delta"].get("tool_calls") or []:
                    entry = found.setdefault(d["index"], [d["function"].get("name"), ""])
                    entry[1] += d["function"].get("arguments") or ""
        return [tuple(found[i]) for i in sorted(found)]
    _, whole = read_all(url, body)
    job_id, first = read_some(url, body, cut)
    resp, rest = read_all(url, body, {"Last-Event-ID": first[-1][0]})
    assert resp.status_code == 200
    assert calls(first + rest) == calls(whole) and calls(whole)
    assert normalized(first + rest)[-2:] == normalized(whole)[-2:]    # finish, [DONE]
    assert [p for p, _ in normalized(first + rest)] == [p for p, _ in normalized(whole)]
    _, replay = read_all(f"{gw.v1}/streams/{job_id}", None)
    assert first + rest == replay


def test_a_resumed_stream_keeps_the_requests_deadline(redis_server, gateway_factory):
    """No worker ever comes: the resumed stream still ends on the request's own time
    (X-Request-Timeout), with the job cancelled, as the first connection would have."""
    gw = gateway_factory(redis_server.url, resume_grace_s=10.0, routes=["fake=default"],
                         wait_for_worker=True)
    headers = {"X-Request-Timeout": "2"}
    with httpx.stream("POST", f"{gw.v1}/completions", json=completion_body(max_tokens=5),
                      headers=headers, timeout=30) as resp:
        job_id = resp.headers["x-job-id"]
        assert next(resp.iter_lines()).startswith(":")
    t0 = time.monotonic()
    resp, events = read_all(f"{gw.v1}/streams/{job_id}", None)
    assert time.monotonic() - t0 < 10
    if resp.status_code == 200:
        assert events[-1] == (None, "[DONE]")           # no event of the job came before
        assert json.loads(events[-2][1])["error"]["code"] == "expired"
    else:
        assert resp.status_code == 504 and error_code(resp) == "expired"
    wait_for(lambda: redis.Redis.from_url(redis_server.url).exists(KEYS.cancel(job_id)),
             timeout=10, what="the cancel flag")


def test_resume_and_grace_on_a_redis_cluster(redis_cluster, tmp_path, gateway_factory):
    """On a 3-master cluster with a 3-shard queue: records live in their own slots (the job
    id's tag), the parked set in another; a resume lands on a second gateway, a second
    client that never comes back has its job cancelled by the sweep."""
    from tests.fault_harness import FaultEnv
    from tokenrelay.protocol.keys import Keys as QueueKeys
    env = FaultEnv(tmp_path, namespace="rsm", shards=3, cluster=redis_cluster)
    try:
        env.worker("w1", delay=0.05)
        gws = [gateway_factory(redis_cluster.url, namespace="rsm", shards=3, cluster="on",
                               resume_grace_s=1.0) for _ in range(2)]
        body = completion_body(logprobs=None)
        job_id, first = read_some(f"{gws[0].v1}/completions", body, 4)
        resp, rest = read_all(f"{gws[1].v1}/completions", body, {"Last-Event-ID": first[-1][0]})
        assert resp.status_code == 200, resp.text
        texts = [json.loads(d)["choices"][0]["text"] for _, d in first + rest if d != "[DONE]"]
        assert "".join(texts) == fake_completion("resume me", 30)
        gone, _ = read_some(f"{gws[1].v1}/completions", completion_body(max_tokens=3000), 3)
        keys = QueueKeys("rsm", env.keys.queue, 3)
        wait_for(lambda: env.r.exists(keys.cancel(gone)), timeout=15, what="the cancel flag")
        assert env.r.hget(stream_session_key("rsm", gone), "state") == b"cancelled"
    finally:
        env.close()


def test_the_openai_client_reads_keep_alives_between_events_with_ids(
        redis_server, start_worker, gateway_factory):
    """Engine steps slower than --keepalive-s: keep-alives come between events with ids. The
    openai package's SSE decoder dispatches an empty event at a blank line once it holds an
    id (and fails to parse it), so after an id the keep-alive is the comment line alone."""
    import openai
    start_worker(engine=FakeEngine(step_delay=0.5))
    gw = gateway_factory(redis_server.url, keepalive_s=0.1)
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model=MODEL, prompt="slow", max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fake_completion("slow", 4)
    with httpx.stream("POST", f"{gw.v1}/completions", timeout=30,
                      json={**completion_body(max_tokens=3), "prompt": "slow"}) as resp:
        raw = resp.read().decode()
    after_id = raw[raw.index("id: "):]
    assert ": keep-alive\n" in after_id and ": keep-alive\n\n" not in after_id
