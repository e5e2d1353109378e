"""Honest exits (#40): ``batch`` exits 1 while its errors file holds a line (``--allow-failures``:
0), says at a steady interval that a queue it waits on has no live worker, ``status --batch``
counts the errors file; ``cancel`` of a finished job exits 10; JobNotFound names the queue."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fault_harness import wait_for
from tests.sdk.test_batch_runner import read_jsonl, write_input
from tests.sdk_helpers import FakeWorker, env_with_repo, sdk_redis, sdk_url  # noqa: F401
from tokenrelay.producer_sdk import Client, JobNotFound
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.producer_sdk.batch.watch import WorkerWatch
from tokenrelay.producer_sdk.cli.exit_codes import (EXIT_CODES, EXIT_FAILED, EXIT_FINISHED,
                                                EXIT_UNKNOWN)

pytestmark = pytest.mark.timeout(120)


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay", *args, "--redis-url", url],
                          env=env_with_repo(), capture_output=True, text=True, timeout=90)


def test_batch_exit_codes_and_status_counts_the_errors_file(sdk_url: str, tmp_path: Path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    write_input(good, 4, {})
    write_input(bad, 4, {2: "not json"})
    with FakeWorker(sdk_url, queue="exits"):
        run = cli(sdk_url, "batch", str(good), str(tmp_path / "good.out"), "--no-progress",
                  "--queue", "exits")
        assert run.returncode == 0, run.stderr
        run = cli(sdk_url, "batch", str(bad), str(tmp_path / "bad.out"), "--no-progress",
                  "--queue", "exits")
        assert run.returncode == EXIT_FAILED, run.stderr
        assert "1 line(s)" in run.stderr and "--allow-failures" in run.stderr
        # a rerun answers nothing new, but the errors file still holds the line
        again = cli(sdk_url, "batch", str(bad), str(tmp_path / "bad.out"), "--no-progress",
                    "--queue", "exits")
        assert again.returncode == EXIT_FAILED
        allowed = cli(sdk_url, "batch", str(bad), str(tmp_path / "bad.out"), "--no-progress",
                      "--queue", "exits", "--allow-failures")
        assert allowed.returncode == 0, allowed.stderr
        status = cli(sdk_url, "status", "--batch", str(bad), "--output",
                     str(tmp_path / "bad.out"), "--queue", "exits")
    assert status.returncode == 0, status.stderr
    counts = json.loads(status.stderr.strip().splitlines()[-1])
    assert counts["errors_file_lines"] == 1
    assert sum(counts["errors_by_code"].values()) == 1
    assert counts["done"] == 3 and counts["malformed_lines"] == 1


def test_a_batch_waiting_on_a_queue_without_workers_says_so(sdk_url: str, tmp_path: Path):
    inp = tmp_path / "in.jsonl"
    write_input(inp, 2, {})
    said: list[str] = []
    with Client(sdk_url, queue="lonely") as client:
        runner = BatchRunner(client, inp, tmp_path / "out.jsonl", progress=False,
                             wait_log_s=0.2)
        runner.watch.say = said.append
        done: list = []
        thread = threading.Thread(target=lambda: done.append(runner.run()), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while len(said) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(said) >= 3, said         # steadily, while nothing can run
            assert "model 'tiny'" in said[0] and "queue 'lonely'" in said[0]
            with FakeWorker(sdk_url, queue="lonely"):
                thread.join(30)
                quiet = len(said)
        finally:
            thread.join(30)
    assert done and done[0].succeeded == 2
    assert len(said) <= quiet + 1               # a live worker silences it
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2


def test_watch_reports_only_queues_without_live_workers(sdk_url: str):
    said: list[str] = []
    with Client(sdk_url) as client, FakeWorker(sdk_url, queue="busy"):
        wait_for(lambda: client.live_workers("busy"), 10, what="the busy queue's worker")
        watch = WorkerWatch(client, 5.0, say=said.append)
        watch.sent("a", "busy")
        watch.sent("b", "idle")
        watch.check()
    assert len(said) == 1 and "'b'" in said[0] and "'idle'" in said[0]
    with pytest.raises(ValueError):
        WorkerWatch(None, 0)


def test_cancel_of_a_finished_job_and_unknown_ids(sdk_url: str):
    with FakeWorker(sdk_url, queue="fin"), Client(sdk_url, queue="fin") as client:
        job = client.submit("hi", max_tokens=2)
        job.result(timeout=20)
        finished = cli(sdk_url, "cancel", job.id, "--queue", "fin")
        assert finished.returncode == EXIT_FINISHED
        assert "already finished" in finished.stderr
        unknown = cli(sdk_url, "cancel", job.id)            # searched on "default"
        assert unknown.returncode == EXIT_UNKNOWN
        assert "queue 'default'" in unknown.stderr
        with pytest.raises(JobNotFound, match="queue 'other'"):
            client.get(job.id, queue="other")
        status = cli(sdk_url, "status", job.id, "--queue", "other")
        assert status.returncode == EXIT_UNKNOWN and "queue 'other'" in status.stderr


def test_one_table_of_exit_codes_in_help_and_readme():
    out = subprocess.run([sys.executable, "-m", "tokenrelay", "submit", "--help"],
                         env=env_with_repo(), capture_output=True, text=True, timeout=60)
    top = subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", "--help"],
                         env=env_with_repo(), capture_output=True, text=True, timeout=60)
    one = subprocess.run([sys.executable, "-m", "tokenrelay", "--help"], env=env_with_repo(),
                         capture_output=True, text=True, timeout=60)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for code, what in EXIT_CODES:
        assert f"{code:>2}  {what}" in top.stdout and f"{code:>2}  {what}" in one.stdout
        assert f"| {code} | {what} |" in readme, what
    assert out.returncode == 0 and "exit codes:" in out.stdout
