"""The batch runner's guard rails (issue #25): one run per output file at a time (a second
refuses, exit 9, and the output has exactly one line per request), a UTF-8 BOM accepted,
``body.model`` required, every errors-file line in OpenAI's Batch shape (validated with the
``openai`` package's ``BatchError``), and ``status --batch`` counting each custom_id once and
naming malformed lines. Real redis-server, the fake worker of tests/sdk_helpers.py, the CLI as
subprocesses."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.producer_sdk.batch.lock import BatchLocked, OutputLock
from tests.fault_harness import wait_for
from tests.sdk.test_batch_runner import chat_line, completion_line, read_jsonl, write_input
from tests.sdk_helpers import FakeWorker, env_with_repo, sdk_redis, sdk_url  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def batch_cli(sdk_url: str, inp: Path, out: Path, err: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenrelay.producer_sdk", "batch", str(inp), str(out), "--errors", str(err),
         "--concurrency", "8", "--batch-id", "twice", "--redis-url", sdk_url, "--no-progress"],
        env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_runs_at_once_one_refuses_and_each_request_has_one_line(sdk_url, tmp_path):
    """The second run starts once the first is writing (its first output line is there) and
    has seconds of work left (a slow worker), so the two surely overlap."""
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_input(inp, 40, {}, max_tokens=4)
    procs: list[subprocess.Popen] = []
    with FakeWorker(sdk_url, token_delay=0.05):     # ~0.2 s a job, one at a time: ~8 s
        try:
            procs.append(batch_cli(sdk_url, inp, out, err))
            wait_for(lambda: read_jsonl(out) or procs[0].poll() is not None, 60,
                     what="the first run's first output line")
            assert procs[0].poll() is None, procs[0].communicate()
            procs.append(batch_cli(sdk_url, inp, out, err))
            _, refused = procs[1].communicate(timeout=60)
            assert procs[1].returncode == 9, refused     # refused while the first held it
            _, first_err = procs[0].communicate(timeout=100)
            assert procs[0].returncode == 0, first_err
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    assert "another batch run (pid" in refused and str(out) in refused
    ids = [o["custom_id"] for o in read_jsonl(out)]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(40)) and not read_jsonl(err)


@contextlib.contextmanager
def lock_holder(out: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``out``'s lock until the block ends (then SIGKILLed)."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from tokenrelay.producer_sdk.batch.lock import "
        f"OutputLock; l = OutputLock(Path({str(out)!r})).__enter__(); print('held', flush=True);"
        " time.sleep(60)")], env=env_with_repo(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait(10)


def test_a_lock_left_by_a_dead_holder_does_not_block(tmp_path):
    out = tmp_path / "out.jsonl"
    with lock_holder(out) as holder:
        with pytest.raises(BatchLocked, match=f"pid {holder.pid}"):
            OutputLock(out).__enter__()
    with OutputLock(out):           # the kernel released the killed holder's lock
        pass


@pytest.mark.parametrize("alias", ["symlink", "hardlink", "relative"])
def test_the_lock_is_the_files_not_the_names(tmp_path, alias, monkeypatch):
    """The same output file named another way (a symlink, a hard link, a relative path) meets
    the lock of a run that holds it (issue #42: two runs through a symlink wrote 60 lines for
    30 requests); a different file does not."""
    out = tmp_path / "out.jsonl"
    other = tmp_path / "elsewhere"
    other.mkdir()
    with lock_holder(out) as holder:
        if alias == "symlink":
            name = other / "link.jsonl"
            name.symlink_to(out)
            expected = f"pid {holder.pid}"
        elif alias == "hardlink":
            name = other / "hard.jsonl"
            name.hardlink_to(out)
            expected = "another hard link"
        else:
            monkeypatch.chdir(other)
            name = Path("..") / "out.jsonl"
            expected = f"pid {holder.pid}"
        with pytest.raises(BatchLocked, match=expected):
            OutputLock(name).__enter__()
        with OutputLock(other / "another.jsonl"):
            pass


def test_bom_missing_model_and_openai_error_shape(sdk_url, tmp_path):
    from openai.types import BatchError
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    no_model = json.loads(completion_line(2))
    del no_model["body"]["model"]
    lines = [chat_line(0), completion_line(1), json.dumps(no_model), "{broken",
             json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions"})]
    inp.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())
    with FakeWorker(sdk_url), Client(sdk_url) as client:
        summary = BatchRunner(client, inp, out, err, batch_id="bom", progress=False).run()
    assert (summary.succeeded, summary.malformed) == (2, 3), read_jsonl(err)
    assert sorted(o["custom_id"] for o in read_jsonl(out)) == ["req-0", "req-1"]
    errors = {e["error"]["line"]: e for e in read_jsonl(err)}
    assert sorted(errors) == [3, 4, 5]
    for e in errors.values():
        assert set(e) == {"id", "custom_id", "response", "error"} and e["response"] is None
        assert set(e["error"]) == set(BatchError.model_fields)
        BatchError.model_validate(e["error"], strict=True)
    missing = errors[3]["error"]
    assert (errors[3]["custom_id"], missing["code"], missing["param"]) == (
        "req-2", "invalid_request", "model")
    assert "body.model is required" in missing["message"]
    assert errors[4]["error"]["code"] == "invalid_json"


def test_status_of_a_batch_counts_each_custom_id_once_and_names_malformed_lines(
        sdk_url, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([completion_line(0), completion_line(1), completion_line(0),
                              "not json", json.dumps({"custom_id": "m", "method": "POST",
                                                      "url": "/v1/completions",
                                                      "body": {"prompt": "p"}})]) + "\n")
    done = subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", "status", "--batch", str(inp),
                           "--batch-id", "st", "--redis-url", sdk_url, "--json"],
                          capture_output=True, text=True, timeout=60, env=env_with_repo())
    assert done.returncode == 0, done.stderr
    rows = [json.loads(x) for x in done.stdout.splitlines()]
    assert [r["custom_id"] for r in rows if "custom_id" in r] == ["req-0", "req-1"]
    malformed = {r["line"]: r["malformed"] for r in rows if "line" in r}
    assert sorted(malformed) == [3, 4, 5]
    assert "duplicate_custom_id" in malformed[3] and "line 1" in malformed[3]
    assert malformed[4].startswith("invalid_json") and "body.model" in malformed[5]
    assert json.loads(done.stderr.splitlines()[-1]) == {
        "batch_id": "st", "jobs": 2, "unknown": 2, "malformed_lines": 3}
