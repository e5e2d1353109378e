"""Redis errors against real redis-server processes and ``tokenrelay worker`` children (issue #13
findings 2 and 7, docs/contracts.md "Redis errors"): a Redis out of memory pauses the worker and
loses nothing; a configuration error ends it with one clear line and exit 78."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis

from tests.fault_harness import FaultEnv, submit, wait_for
from tests.fixtures_redis import REPO_ROOT
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def env(tmp_path):
    e = FaultEnv(tmp_path, redis_args=("--maxmemory", "24mb", "--maxmemory-policy", "noeviction"))
    yield e
    e.close()


def fill_until_oom(r: redis.Redis) -> int:
    """Write filler keys until Redis refuses with OOM, then pin maxmemory 4 MB below what is
    used: the worker's own acks and deletes free a few KB, and just over the limit that let
    its next write through at once (the worker then rightly resumed, and the test measured
    nothing); returns how many keys were written."""
    n = 0
    while True:
        try:
            r.set(f"filler:{n}", b"x" * 200_000)
        except redis.exceptions.OutOfMemoryError:
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", str(max(1, used - 4 * 2**20)))
            return n
        n += 1


def log_lines(wp) -> list[dict]:
    out = []
    for line in wp.log().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_redis_out_of_memory_loses_no_job(env):
    """Jobs running and queued when Redis fills up neither fail nor dead-letter; once memory is
    freed every one finishes with its terminal event, and the worker's log stays bounded."""
    w = env.worker("w1", model="fake:step_delay=0.02,max_num_seqs=16")
    r = env.r
    jobs = [f"oom-{i}" for i in range(40)]
    for jid in jobs:
        submit(r, env.keys, {"job_id": jid, "prompt": f"prompt {jid}",
                             "params": {"max_tokens": 150, "temperature": 0}})
    wait_for(lambda: r.exists(env.keys.results(jobs[0])), 30, what="the first job started")
    fill_until_oom(r)
    # Redis refuses writes now: the worker must hold on for a while without giving anything up
    wait_for(lambda: "pausing intake" in w.log(), 30, what="the worker noticing OOM")
    lines_at_oom = len(log_lines(w))
    errors_at_oom = r.info("stats")["total_error_replies"]
    paused_at = time.monotonic()

    def held_on_and_retried() -> bool:
        """Backoff doubles from 50 ms to 5 s: by 12 s a live worker has retried at least 8
        times (each refused write is an error reply), however slow the machine."""
        retried = r.info("stats")["total_error_replies"] - errors_at_oom
        return time.monotonic() - paused_at > 12 and retried >= 6

    wait_for(held_on_and_retried, 60, interval=0.5, what="the worker retrying through the OOM")
    assert w.proc.poll() is None, w.log()[-3000:]
    assert r.xlen(env.keys.dead()) == 0
    for rep in env.streams(jobs).values():
        assert rep.terminal is None or rep.terminal.type == "done", rep.kind
    paused_lines = len(log_lines(w)) - lines_at_oom
    assert paused_lines < 60, f"{paused_lines} log lines while retrying through OOM"
    r.config_set("maxmemory", "24mb")
    for key in r.scan_iter("filler:*", count=1000):
        r.delete(key)
    reports = env.wait_ended(jobs, 90)
    for jid, rep in reports.items():
        assert rep.kind == "done:length" and not rep.problems, (jid, rep.kind, rep.problems)
        assert rep.text == fake_completion(f"prompt {jid}", 150)
    env.assert_exactly_once(reports)
    assert r.xlen(env.keys.dead()) == 0


def run_worker(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.worker", *argv], cwd=str(REPO_ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_wrong_password_exits_78_with_one_line_and_health_says_why(redis_server_factory):
    srv = redis_server_factory()
    srv.client().config_set("requirepass", "right-secret")
    url = f"redis://:wrong-secret@127.0.0.1:{srv.port}/0"
    out = run_worker("--model", "fake:", "--redis-url", url, "--worker-id", "w78",
                     "--device", "cpu")
    assert out.returncode == 78, out.stderr[-2000:]
    errors = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")
              and json.loads(x).get("level") == "error"]
    assert len(errors) == 1 and "configuration error" in errors[0]["event"]
    assert "wrong-secret" not in out.stderr                  # the password is never logged
    health = run_worker("health", "--redis-url", url, "--worker-id", "w78")
    assert health.returncode != 0
    assert "configuration error" in health.stderr, health.stderr
