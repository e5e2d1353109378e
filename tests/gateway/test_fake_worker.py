"""The gateway with the official ``openai`` client (sync and async) against a real redis-server
and an in-process worker on the FakeEngine, whose output is a known function of the prompt:
shapes (validated strictly against the openai package's own types, from raw JSON too), n,
seeds, usage, keep-alives, every error status, auth lanes, disconnect-cancels."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import redis

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import Keys
from tests.fault_harness import wait_for
from tests.gateway.helpers import (chunk_texts, finish_reasons, sse_events, stream_raw,
                                   strict_chunks)
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

pytestmark = pytest.mark.timeout(120)
KEYS = Keys()
MODEL = "fake"          # the served name of a --model fake: worker
CHAT = [{"role": "user", "content": "Name a colour."}]


def rendered(messages=CHAT) -> str:
    return FakeEngine().render_chat(messages)


@pytest.fixture
def gw(redis_server, start_worker, gateway_factory):
    start_worker()
    return gateway_factory(redis_server.url)


def oai(gw, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def test_completion_and_chat_whole_through_the_openai_client(gw):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    client = oai(gw)
    comp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=5,
                                     temperature=0)
    assert comp.choices[0].text == fake_completion("hello there", 5)
    assert comp.choices[0].finish_reason == "length" and comp.object == "text_completion"
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens, comp.usage.total_tokens) \
        == (11, 5, 16)
    assert comp.id.startswith("cmpl-") and comp.model == MODEL and comp.created > 0
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content == fake_completion(rendered(), 4)
    assert chat.choices[0].message.role == "assistant" and chat.id.startswith("chatcmpl-")
    assert chat.usage.prompt_tokens == len(rendered()) and chat.usage.total_tokens == \
        len(rendered()) + 4
    # The same bodies as raw JSON, validated strictly (no coercion) by the openai types.
    raw = httpx.post(f"{gw.v1}/completions", timeout=30, json={
        "model": MODEL, "prompt": "hello there", "max_tokens": 5, "temperature": 0}).json()
    Completion.model_validate(raw, strict=True)
    raw = httpx.post(f"{gw.v1}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_completion_tokens": 4}).json()
    assert ChatCompletion.model_validate(raw, strict=True).usage.completion_tokens == 4


def test_streaming_chat_and_completion_with_usage(gw):
    client = oai(gw)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        fake_completion(rendered(), 6)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert finish_reasons(chunks) == {0: "length"}
    resp, events = stream_raw(f"{gw.v1}/completions", {
        "model": MODEL, "prompt": "stream me", "max_tokens": 7, "temperature": 0,
        "stream": True})
    assert resp.headers["content-type"].startswith("text/event-stream")
    parsed = strict_chunks(False, events)
    assert chunk_texts(False, parsed) == {0: fake_completion("stream me", 7)}
    assert finish_reasons(parsed) == {0: "length"}
    assert all(c.usage is None for c in parsed)     # not asked for: no usage field at all
    assert all("usage" not in obj for k, obj in events if k == "data")
    assert len({c.id for c in parsed}) == 1 and parsed[0].id.startswith("cmpl-")


def test_n_2_and_seeded_sampling_reproducible(gw):
    client = oai(gw)
    want = [fake_completion("seeded", 5, seed=11, greedy=False, choice=i) for i in range(2)]
    assert want[0] != want[1]
    for _ in range(2):      # the same seed gives the same choices every time
        comp = client.completions.create(model=MODEL, prompt="seeded", max_tokens=5, n=2,
                                         seed=11, temperature=1.0)
        assert [(c.index, c.text) for c in comp.choices] == list(enumerate(want))
        assert comp.usage.completion_tokens == 10
    other = client.completions.create(model=MODEL, prompt="seeded", max_tokens=5, seed=12,
                                      temperature=1.0)
    assert other.choices[0].text == fake_completion("seeded", 5, seed=12, greedy=False)
    resp, events = stream_raw(f"{gw.v1}/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, "seed": 5,
        "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}})
    chunks = strict_chunks(True, events)
    assert chunk_texts(True, chunks) == {
        i: fake_completion(rendered(), 4, seed=5, greedy=False, choice=i) for i in range(2)}
    assert finish_reasons(chunks) == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 8


def test_logprobs_carry_each_tokens_text_and_bytes(gw):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    raw = httpx.post(f"{gw.v1}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 1}).json()
    content = ChatCompletion.model_validate(raw, strict=True).choices[0].logprobs.content
    text = fake_completion(rendered(), 3)
    assert [t.token for t in content] == list(text)
    assert [t.bytes for t in content] == [list(ch.encode()) for ch in text]
    assert all(t.logprob == -0.5 and len(t.top_logprobs) == 1 for t in content)
    raw = httpx.post(f"{gw.v1}/completions", timeout=30, json={
        "model": MODEL, "prompt": "lp", "max_tokens": 3, "temperature": 0, "logprobs": 1}).json()
    lp = Completion.model_validate(raw, strict=True).choices[0].logprobs
    assert lp.token_logprobs == [-0.5] * 3 and len(lp.top_logprobs) == 3
    plain = httpx.post(f"{gw.v1}/completions", timeout=30, json={
        "model": MODEL, "prompt": "lp", "max_tokens": 3}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_async_client_streams_and_answers(gw):
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=gw.v1, api_key="none", max_retries=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                                      temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        comp = await client.completions.create(model=MODEL, prompt="async", max_tokens=3,
                                               temperature=0)
        await client.close()
        return text, comp.choices[0].text
    assert asyncio.run(run()) == (fake_completion(rendered(), 5), fake_completion("async", 3))


def test_models_health_metrics_and_request_id(gw):
    from openai.types import Model
    models = oai(gw).models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{gw.v1}/models").json()
    assert raw["object"] == "list" and Model.model_validate(raw["data"][0], strict=True).created
    assert httpx.get(f"{gw.url}/health").json() == {"status": "ok"}
    resp = httpx.post(f"{gw.v1}/completions", headers={"X-Request-Id": "abc-123"}, timeout=30,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert resp.headers["x-request-id"] == "abc-123" and resp.headers["x-job-id"]
    assert httpx.get(f"{gw.v1}/models").headers["x-request-id"].startswith("req-")
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'tokenrelay_gateway_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "tokenrelay_gateway_tokens_total" in metrics


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"n": "2"}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": None}, "model"),
])
def test_400_names_the_field(gw, body, param):
    req = {"model": MODEL, "prompt": "x", **body}
    resp = httpx.post(f"{gw.v1}/completions", json=req, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai(gw).completions.create(model=MODEL, prompt="x", extra_body=body)
    assert exc.value.status_code == 400


def test_404_unknown_model_503_no_live_worker(redis_server, gateway_factory):
    gw = gateway_factory(redis_server.url, routes=["ghost=ghostq"])
    client = oai(gw)
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="x")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="ghost", prompt="x")
    assert exc.value.status_code == 503 and exc.value.body["code"] == "no_live_worker"


def test_503_once_the_last_worker_of_a_model_left(redis_server, start_worker,
                                                  gateway_factory):
    w = start_worker()
    gw = gateway_factory(redis_server.url)
    client = oai(gw)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
    w.stop()                    # a clean exit deletes the heartbeat
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT)
    assert exc.value.status_code == 503


def test_401_and_a_priority_lane_per_key(redis_server, start_worker, gateway_factory,
                                         tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\nk-bulk 1\n")
    start_worker(engine=FakeEngine(max_num_seqs=1, step_delay=0.02))
    gw = gateway_factory(redis_server.url, api_keys=["k-urgent -1", "k-plain"],
                         api_keys_file=str(keyfile))
    with pytest.raises(openai.AuthenticationError):
        oai(gw, api_key="wrong").completions.create(model=MODEL, prompt="x")
    assert httpx.get(f"{gw.v1}/models").status_code == 401
    assert httpx.get(f"{gw.url}/health").status_code == 200        # probes need no key
    assert oai(gw, api_key="k-plain").models.list().data[0].id == MODEL
    # One long job holds the worker's only slot, so the next ones wait in their lanes.
    with httpx.stream("POST", f"{gw.v1}/completions", timeout=60,
                      headers={"Authorization": "Bearer k-plain"},
                      json={"model": MODEL, "prompt": "long", "max_tokens": 2000,
                            "stream": True}) as hold:
        lanes = {}
        for key in ("k-urgent", "k-bulk"):
            with httpx.stream("POST", f"{gw.v1}/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "prompt": "q", "max_tokens": 2,
                                    "stream": True}) as resp:
                assert resp.status_code == 200
                with Client(redis_server.url) as c:
                    lanes[key] = c.status(resp.headers["x-job-id"]).lane
        assert hold.status_code == 200
    assert lanes == {"k-urgent": "urgent", "k-bulk": "bulk"}


def test_429_when_the_queue_is_full(redis_server, start_worker, gateway_factory):
    start_worker(engine=FakeEngine(max_num_seqs=1, step_delay=0.02))
    gw = gateway_factory(redis_server.url, retry_after_s=3)
    with Client(redis_server.url) as c:
        c.set_max_queued_jobs(1)
        held = c.submit("hold", max_tokens=2000)
        with pytest.raises(openai.RateLimitError) as exc:
            oai(gw).completions.create(model=MODEL, prompt="x")
        held.cancel()
    assert exc.value.response.headers["retry-after"] == "3"
    assert exc.value.body["code"] == "queue_full"


def test_504_when_the_deadline_passes_before_the_job_starts(redis_server, start_worker,
                                                             gateway_factory):
    """The only slot is held for ~2 s; jobs allowed 0.3 s in the queue expire when read."""
    start_worker(engine=FakeEngine(max_num_seqs=1, step_delay=0.02))
    patient = gateway_factory(redis_server.url, status_wait_s=10)
    eager = gateway_factory(redis_server.url)         # headers after 0.2 s
    late = {"X-Request-Timeout": "0.3"}
    with Client(redis_server.url) as c:
        for stream in (False, True):
            c.submit("hold", max_tokens=100)
            resp = httpx.post(f"{patient.v1}/chat/completions", timeout=30, headers=late,
                              json={"model": MODEL, "messages": CHAT, "stream": stream})
            assert resp.status_code == 504, resp.text
            assert resp.json()["error"]["code"] == "expired"
        c.submit("hold", max_tokens=100)
        with pytest.raises(openai.APIStatusError) as exc:
            oai(patient).completions.create(model=MODEL, prompt="x", extra_headers=late)
        assert exc.value.status_code == 504
        # Past status_wait_s the stream has begun: the expiry comes as an SSE error event,
        # which the openai client raises.
        c.submit("hold", max_tokens=100)
        resp, events = stream_raw(f"{eager.v1}/completions", headers=late, body={
            "model": MODEL, "prompt": "x", "stream": True})
        assert resp.status_code == 200 and events[-1] == ("done", None)
        assert events[-2][1]["error"]["code"] == "expired"
        c.submit("hold", max_tokens=100)
        with pytest.raises(openai.APIError, match="deadline"):
            for _ in oai(eager).completions.create(model=MODEL, prompt="x", stream=True,
                                                   extra_headers=late):
                pass


def test_keepalive_comments_while_the_job_waits_in_its_queue(redis_server, start_worker,
                                                             gateway_factory):
    start_worker(engine=FakeEngine(max_num_seqs=1, step_delay=0.02))
    gw = gateway_factory(redis_server.url)
    with Client(redis_server.url) as c:
        held = c.submit("hold", max_tokens=60)          # ~1.2 s of the only slot
        resp, events = stream_raw(f"{gw.v1}/completions", {
            "model": MODEL, "prompt": "after", "max_tokens": 3, "temperature": 0,
            "stream": True})
        assert held.result(timeout=30).finish_reason == "length"
    kinds = [k for k, _ in events]
    assert kinds.index("comment") < kinds.index("data")
    assert kinds.count("comment") >= 2 and ("comment", "keep-alive") in events
    assert chunk_texts(False, strict_chunks(False, events)) == {0: fake_completion("after", 3)}


def test_disconnect_mid_stream_cancels_the_job(redis_server, start_worker,
                                               gateway_factory):
    """With no resume grace (``--resume-grace-s 0``) a disconnect cancels at once, as before
    resumable streams (tests/gateway/test_resume.py: the grace)."""
    start_worker(engine=FakeEngine(step_delay=0.02))
    gw = gateway_factory(redis_server.url, resume_grace_s=0)
    r = redis.Redis.from_url(redis_server.url)
    with httpx.stream("POST", f"{gw.v1}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 3000, "stream": True}) as resp:
        job_id = resp.headers["x-job-id"]
        events = sse_events(resp.iter_lines())
        got = [next(events) for _ in range(5)]
        assert all(k == "data" for k, _ in got)
    wait_for(lambda: r.exists(KEYS.cancel(job_id)), timeout=10, what="the cancel flag")
    with Client(redis_server.url) as c:
        result = c.get(job_id).result(timeout=20)
    assert result.finish_reason == "cancelled" and result.usage.completion_tokens < 3000
    assert "tokenrelay_gateway_disconnect_cancels_total 1.0" in httpx.get(
        f"{gw.url}/metrics").text


def test_disconnect_while_waiting_for_a_whole_answer_cancels_the_job(
        redis_server, start_worker, gateway_factory):
    start_worker(engine=FakeEngine(step_delay=0.02))
    gw = gateway_factory(redis_server.url)
    r = redis.Redis.from_url(redis_server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.v1}/completions", timeout=1.0, json={
            "model": MODEL, "prompt": "whole", "max_tokens": 3000})
    ids = wait_for(lambda: list(r.scan_iter(match=KEYS.cancel("*"))), timeout=10,
                   what="a cancel flag")
    job_id = ids[0].decode().rsplit("}:", 1)[1]
    t0 = time.monotonic()
    with Client(redis_server.url) as c:
        assert c.get(job_id).result(timeout=20).finish_reason == "cancelled"
    assert time.monotonic() - t0 < 20


def test_prompt_cache_key_routes_by_affinity_and_user_does_not(redis_server, start_worker,
                                                                gateway_factory):
    """Requests with one ``prompt_cache_key`` all run on the worker rendezvous hashing gives
    that key; one ``user`` with two keys homed on different workers runs on both."""
    from tokenrelay.producer_sdk.core.affinity import rank
    from tests.fault_harness import read_events
    start_worker(worker_id="w1")
    start_worker(worker_id="w2")
    client = oai(gateway_factory(redis_server.url))
    keys = [next(f"conv-{i}" for i in range(100) if rank(f"conv-{i}", ["w1", "w2"])[0] == w)
            for w in ("w1", "w2")]
    r = redis.Redis.from_url(redis_server.url)
    for key, home in zip(keys, ("w1", "w2")):
        for turn in range(3):
            out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                 prompt_cache_key=key, user="alice")
            job_id = out.id.removeprefix("chatcmpl-")
            assert [e.worker_id for e in read_events(r, KEYS, job_id)
                    if e.type == "started"] == [home], (key, turn)
    r.close()


def test_each_keys_jobs_carry_its_fingerprint_as_producer(redis_server, start_worker,
                                                          gateway_factory):
    """The worker shares grammar compiles fairly among producers (#42): the gateway's jobs
    name their API key's producer, a fingerprint that never reveals the key."""
    fake = FakeEngine()
    start_worker(engine=fake)
    gw = gateway_factory(redis_server.url, api_keys=["k-alpha", "k-beta"])
    ids = {}
    for key in ("k-alpha", "k-beta", "k-alpha"):
        resp = httpx.post(f"{gw.v1}/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert resp.status_code == 200
        ids.setdefault(key, []).append(resp.headers["x-job-id"])
    owners = {key: {fake.owners[j] for j in jobs} for key, jobs in ids.items()}
    assert all(len(o) == 1 for o in owners.values())
    alpha, beta = owners["k-alpha"].pop(), owners["k-beta"].pop()
    assert alpha != beta and alpha.startswith("key-") and "alpha" not in alpha
