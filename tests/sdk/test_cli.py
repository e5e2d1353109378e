"""``tokenrelay`` submit / stats / cancel as subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import redis

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import Keys
from tests.sdk_helpers import FakeWorker, env_with_repo, free_port, sdk_redis, sdk_url  # noqa: F401


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", *args], capture_output=True,
                          text=True, timeout=timeout, env=env_with_repo(env))


def test_submit_streams_tokens(sdk_url: str):
    with FakeWorker(sdk_url, token_delay=0.01):
        res = cli("submit", "hello there", "--stream", "--max-tokens", "5", "--temperature", "0",
                  env={"TOKENRELAY_REDIS_URL": sdk_url})
        assert res.returncode == 0, res.stderr
        assert res.stdout == " t0 t1 t2 t3 t4\n"
        assert "finish_reason=length" in res.stderr
        res = cli("submit", "FAIL", "--redis-url", sdk_url, "--chat", "--json")
        assert res.returncode == 1 and "internal" in res.stderr
    bad = cli("submit", "x", "--redis-url", sdk_url, "--temperature", "-2")
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_stats_and_cancel(sdk_url: str):
    r = redis.Redis.from_url(sdk_url)
    keys = Keys(queue="q1")
    with Client(sdk_url, queue="q1") as c:
        c.submit("a")
        c.submit("b", priority=5)
        c.set_max_queued_jobs(50)
        c.set_max_queued_tokens(9000)
    r.zadd(keys.workers, {"w1": int(time.time() * 1000), "w-old": 1})
    r.xadd(keys.dead(), {"data": b"x", "reason": "poison"})
    res = cli("stats", "--redis-url", sdk_url, "--json")
    assert res.returncode == 0, res.stderr
    (q,) = json.loads(res.stdout)
    assert (q["queue"], q["depth"], q["workers_live"], q["workers_known"]) == ("q1", 2, 1, 2)
    assert q["dead_letters"] == 1 and q["max_queued_jobs"] == 50
    assert (q["queued_tokens"], q["max_queued_tokens"]) == (2 * (1 + 16), 9000)
    assert q["lanes"]["bulk"]["length"] == 1
    table = cli("stats", "--redis-url", sdk_url).stdout
    assert table.splitlines()[0].split()[:4] == ["queue", "depth", "lag", "pending"]
    assert table.splitlines()[1].split()[:2] == ["q1", "2"]
    res = cli("cancel", "some-job", "--redis-url", sdk_url)      # unknown: exit 6, no flag
    assert res.returncode == 6 and "no job 'some-job'" in res.stderr, res.stderr
    assert not r.exists(Keys().cancel("some-job"))
    with Client(sdk_url) as c:
        c.submit("k", job_id="known-job")
    res = cli("cancel", "known-job", "--redis-url", sdk_url)
    assert res.returncode == 0 and r.exists(Keys().cancel("known-job")), res.stderr
    r.close()


def test_unreachable_redis_exits_3_quickly():
    t0 = time.monotonic()
    res = cli("submit", "x", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert res.returncode == 3 and "cannot reach Redis" in res.stderr
    assert time.monotonic() - t0 < 15


def test_status_and_result_commands(sdk_url: str):
    with Client(sdk_url) as c:
        c.submit("waiting", max_tokens=3, job_id="st1")
        c.submit("waiting too", max_tokens=3, job_id="st2")
    queued = cli("status", "st2", "--redis-url", sdk_url)
    assert queued.returncode == 0 and queued.stdout.split()[:2] == ["st2", "queued"], queued
    assert "lane=default" in queued.stdout and "position=1" in queued.stdout
    unknown = cli("status", "nobody", "--redis-url", sdk_url, "--json")
    assert unknown.returncode == 6 and json.loads(unknown.stdout)["state"] == "unknown"
    assert cli("result", "nobody", "--redis-url", sdk_url).returncode == 6
    assert cli("status", "has space", "--redis-url", sdk_url).returncode == 2
    with FakeWorker(sdk_url):
        res = cli("result", "st1", "--redis-url", sdk_url, "--timeout", "20")
        assert res.returncode == 0 and res.stdout == " t0 t1 t2\n", res
        done = cli("status", "st1", "--redis-url", sdk_url, "--json")
        assert json.loads(done.stdout)["state"] == "done"


def test_submit_with_no_live_worker_says_so_in_one_line(sdk_url: str):
    t0 = time.monotonic()
    res = cli("submit", "anyone?", "--redis-url", sdk_url, "--queue", "empty")
    assert res.returncode == 8 and time.monotonic() - t0 < 15
    (line,) = res.stderr.strip().splitlines()
    assert "no live worker serves queue 'empty'" in line and "--wait-for-worker" in line
    assert not redis.Redis.from_url(sdk_url).exists(Keys(queue="empty").lane("default"))
    waited = cli("submit", "anyone?", "--redis-url", sdk_url, "--queue", "empty",
                 "--wait-for-worker", "--timeout", "0.3")
    assert waited.returncode == 5 and "job " in waited.stderr
