"""Producer SDK (sync client) against a private redis-server and the fake worker."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import redis

from tokenrelay.producer_sdk import Client, JobFailed, JobNotFound, QueueFull, RedisUnavailable
from tokenrelay.protocol.scripts import ENQUEUE
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import decode_job
from tests.fault_harness import wait_for
from tests.sdk_helpers import (FakeWorker, env_with_repo, free_port, sdk_redis,  # noqa: F401
                               sdk_url, start_redis_server)

KEYS = Keys()


def entries(url: str, lane: str = "default") -> list:
    r = redis.Redis.from_url(url)
    try:
        return r.xrange(KEYS.lane(lane))
    finally:
        r.close()


@pytest.fixture
def client(sdk_url: str):
    c = Client(sdk_url)
    yield c
    c.close()


def test_sdk_never_imports_torch():
    code = ("import sys; import tokenrelay, tokenrelay.producer_sdk, tokenrelay.producer_sdk.batch.runner, "
            "tokenrelay.producer_sdk.cli.main, tokenrelay.producer_sdk.aio, tokenrelay.producer_sdk.__main__, "
            "tokenrelay.cli; from tokenrelay import Client; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=env_with_repo(), timeout=60)


def test_payloads_follow_protocol(client: Client, sdk_url: str):
    client.submit("hi", max_tokens=3, stop="x", metadata={"user": 7}, deadline_s=5)
    client.submit(messages=[{"role": "user", "content": "yo"}], priority=-1)
    client.submit(prompt_token_ids=[1, 2, 3], priority=2, stream=False)
    job = decode_job(entries(sdk_url)[0][1][b"data"])
    assert job.prompt == "hi" and job.params == {"max_tokens": 3, "stop": ["x"]}
    assert job.metadata == {"user": 7} and job.deadline_ms - job.submitted_ms == 5000
    assert decode_job(entries(sdk_url, "urgent")[0][1][b"data"]).messages[0].content == "yo"
    bulk = decode_job(entries(sdk_url, "bulk")[0][1][b"data"])
    assert bulk.prompt_token_ids == [1, 2, 3] and bulk.stream is False


@pytest.mark.parametrize("kwargs, field", [
    ({"max_token": 3}, "max_token"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"job_id": "has space"}, "job_id"),
    ({"prompt": None}, "prompt"),
    ({"priority": None}, "priority"),       # None is no default where the model has one
    ({"stream": None}, "stream"),
    ({"metadata": "tag"}, "metadata"),
    ({"deadline_s": 0}, "deadline_s"),
])
def test_bad_fields_rejected_before_sending(client: Client, sdk_url: str, kwargs, field):
    kwargs = {"prompt": "hi", **kwargs}
    with pytest.raises(ValueError, match=field):
        client.submit(**kwargs)
    assert entries(sdk_url) == []


def test_stream_and_result(client: Client, sdk_url: str):
    with FakeWorker(sdk_url):
        job = client.submit("hello", max_tokens=4, metadata={"k": "v"})
        deltas = list(job.stream(timeout=10))
        assert [d.text for d in deltas] == [" t0", " t1", " t2", " t3"]
        assert [d.seq for d in deltas] == [0, 1, 2, 3]
        res = job.result(timeout=5)
        assert res.text == " t0 t1 t2 t3" and res.token_ids == [100, 101, 102, 103]
        assert res.finish_reason == "length" and res.usage.completion_tokens == 4
        assert res.metadata == {"k": "v"} and res.timings.ttft_ms == 2.0
        full = client.submit("x", max_tokens=2, stream=False).result(timeout=10)
        assert full.text == " t0 t1" and full.token_ids == [100, 101]


def test_resumed_job_does_not_repeat_text(client: Client, sdk_url: str):
    with FakeWorker(sdk_url):
        job = client.submit("CRASH", max_tokens=6)
        text = "".join(d.text for d in job.stream(timeout=10))
        assert text == " t0 t1 t2 t3 t4 t5"
        assert job.result().attempts == 2


def test_stream_survives_dropped_connection(client: Client, sdk_url: str):
    admin = redis.Redis.from_url(sdk_url)
    with FakeWorker(sdk_url):
        job = client.submit("SLOW", max_tokens=20)
        got = []
        for d in job.stream(timeout=20):
            got.append(d.text)
            if len(got) == 3:
                def kill_reader():
                    readers = [c for c in admin.client_list() if c["cmd"] == "xread"]
                    for c in readers:
                        admin.client_kill_filter(_id=c["id"])
                    return bool(readers)
                wait_for(kill_reader, timeout=5)
        assert "".join(got) == "".join(f" t{i}" for i in range(20))
    admin.close()


def test_cancel_running_and_queued(client: Client, sdk_url: str):
    queued = client.submit("never", max_tokens=5)
    queued.cancel()
    with FakeWorker(sdk_url) as worker:
        assert queued.result(timeout=10).finish_reason == "cancelled"
        assert queued.state.attempts == 0  # it never started
        running = client.submit("SLOW", max_tokens=200)
        next(iter(running.stream(timeout=10)))
        running.cancel()
        res = running.result(timeout=10)
        assert res.finish_reason == "cancelled" and len(res.token_ids) < 200
    assert worker.processed == [queued.id, running.id]


def test_timeout_failure_and_reattach(client: Client, sdk_url: str):
    job = client.submit("x", job_id="job-1", max_tokens=2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        job.result(timeout=0.3)
    assert time.monotonic() - t0 < 2
    with pytest.raises(JobNotFound):
        client.get("nope")
    with FakeWorker(sdk_url):
        assert client.get("job-1").result(timeout=10).text == " t0 t1"
        with pytest.raises(JobFailed) as err:
            client.submit("FAIL").result(timeout=10)
        assert err.value.code == "internal" and err.value.message == "fake failure"
        with pytest.raises(JobFailed):
            list(client.submit("FAIL").stream(timeout=10))


def test_lost_results_reported(client: Client, sdk_url: str):
    with FakeWorker(sdk_url):
        client.submit("x", job_id="gone", max_tokens=1).result(timeout=10)
    redis.Redis.from_url(sdk_url).delete(KEYS.results("gone"))
    with pytest.raises(JobFailed) as err:
        client.get("gone").result(timeout=5)
    assert err.value.code == "lost"


def test_idempotent_submit(client: Client, sdk_url: str):
    a = client.submit("x", job_id="same")
    b = client.submit("y", job_id="same")
    assert a.id == b.id and b.reattached and not a.reattached
    # A retried script call (what redis-py does after a timeout) enqueues nothing new.
    r = redis.Redis.from_url(sdk_url)
    args = [KEYS.lane("default"), *KEYS.lanes(), KEYS.budget(), KEYS.dedupe("same"), 100,
            86400, 0, "", 0, b"payload", 5]
    reply = r.evalsha(ENQUEUE.sha, 6, *args)
    assert reply[4].startswith(b"=")
    assert len(entries(sdk_url)) == 1
    r.script_flush()  # NOSCRIPT is handled by loading the script and resending
    client.submit("z", job_id="other")
    assert len(entries(sdk_url)) == 2 and r.script_exists(ENQUEUE.sha) == [True]
    assert ENQUEUE.source.count("XADD") == 1
    r.close()


def test_queue_full_client_and_shared_limits(sdk_url: str):
    with Client(sdk_url, max_queued_jobs=2) as c:
        c.submit("a")
        c.submit("b")
        with pytest.raises(QueueFull) as err:
            c.submit("c")
        assert err.value.depth == 2 and err.value.limit == 2
        with pytest.raises(QueueFull):
            c.submit("c", block=True, block_timeout=0.2)
    with Client(sdk_url) as shared:
        shared.set_max_queued_jobs(3)
        shared.submit("c")
        with pytest.raises(QueueFull):
            shared.submit("d")
        with pytest.raises(QueueFull) as err:
            shared.submit_many(["e", "f"], block=False)
        assert err.value.accepted == []
        # block=True waits until a worker drains the queue
        with FakeWorker(sdk_url, start_delay=0.3):
            t0 = time.monotonic()
            jobs = shared.submit_many([f"p{i}" for i in range(10)], max_tokens=1)
            assert time.monotonic() - t0 > 0.2
            assert [j.result(timeout=10).text for j in jobs] == [" t0"] * 10


def test_redis_oom_becomes_backpressure(tmp_path):
    server = start_redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        r = server.client()
        blob = b"x" * 1000
        i = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            while True:
                r.set(f"fill{i}", blob)
                i += 1
        with Client(server.url) as c:
            with pytest.raises(QueueFull) as err:
                c.submit("hi")
            assert err.value.reason == "oom"
            r.delete(*[f"fill{k}" for k in range(i)])
            assert c.submit("hi", block=True, block_timeout=5).id
        r.close()
    finally:
        server.kill()


def test_unreachable_redis_fails_fast():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with Client(url) as c:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as err:
            c.submit("hi")
        assert isinstance(err.value, RedisUnavailable) and "127.0.0.1" in str(err.value)
        with pytest.raises(ConnectionError):
            c.ping()
        assert time.monotonic() - t0 < 5


def test_submit_many_order_and_dedupe(client: Client, sdk_url: str):
    reqs = [f"p{i}" for i in range(1200)] + [{"prompt": "k", "job_id": "known", "priority": 3}]
    client.submit("k", job_id="known", priority=3)
    jobs = client.submit_many(reqs, max_tokens=2)
    assert len(jobs) == 1201 and len({j.id for j in jobs}) == 1201
    assert jobs[-1].id == "known" and jobs[-1].reattached
    ents = entries(sdk_url)
    assert [decode_job(e[1][b"data"]).prompt for e in ents] == [f"p{i}" for i in range(1200)]
    assert len(entries(sdk_url, "bulk")) == 1


def test_map_preserves_order_and_bounds_concurrency(client: Client, sdk_url: str):
    with FakeWorker(sdk_url, token_delay=0.001) as worker:
        prompts = [f"p{i}" for i in range(40)] + ["FAIL"]
        out = client.map(prompts, concurrency=4, progress=False, return_exceptions=True,
                         max_tokens=2)
        assert [r.text for r in out[:40]] == [" t0 t1"] * 40
        assert isinstance(out[40], JobFailed)
        with pytest.raises(JobFailed):
            client.map(["a", "FAIL", "b"], concurrency=2, progress=False, max_tokens=1)
    assert worker.max_depth_seen <= 4


def test_submit_is_thread_safe(client: Client, sdk_url: str):
    ids: list[str] = []

    def work():
        ids.extend(client.submit(f"t{i}").id for i in range(50))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 200 and len(entries(sdk_url)) == 200


def test_bulk_fast_path_payloads_match_general_path(client: Client):
    import msgpack
    builder = client._builder
    defaults = {"max_tokens": 4, "stop": "x", "priority": 2, "metadata": {"a": 1},
                "deadline_s": 3, "stream": False}
    fast = builder.build_many(["p0", {"prompt": "p1", "priority": 0}, "p2"], defaults, 1000)
    for i, p in enumerate(fast):
        slow = builder.build_request(["p0", {"prompt": "p1", "priority": 0}, "p2"][i], defaults,
                                     1000)
        a, b = msgpack.unpackb(p.payload), msgpack.unpackb(slow.payload)
        a.pop("job_id"), b.pop("job_id")
        assert a == b and p.lane == slow.lane and decode_job(p.payload).job_id == p.job_id
    assert [p.lane for p in fast] == ["bulk", "default", "bulk"]
    with pytest.raises(ValueError, match="max_tokens"):
        builder.build_many(["a"], {"max_tokens": 0}, 1000)


def test_oom_is_recognised_from_redis_7_and_from_6_2_scripts():
    from redis.exceptions import OutOfMemoryError, ResponseError
    from tokenrelay.producer_sdk.core.effects import is_oom
    assert is_oom(OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    assert is_oom(ResponseError("Error running script (call to f_2f7b): @user_script:20: "
                                "@user_script: 20: -OOM command not allowed when used memory "
                                "> 'maxmemory'."))
    assert not is_oom(ResponseError("WRONGTYPE Operation against a key"))
    assert not is_oom(b"1-0")
