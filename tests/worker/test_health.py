"""``tokenrelay health`` (worker/health.py): reads the heartbeat through its schema
(protocol/heartbeat.py) and exits 0 only for a fresh beat with the engine loaded."""

from __future__ import annotations

import subprocess
import sys

import fakeredis

from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import now_ms
from tokenrelay.worker.health import check_health


def test_health_check_against_fakeredis():
    r, k = fakeredis.FakeRedis(), Keys()
    assert not check_health(r, k, "w")[0]
    r.hset(k.heartbeat("w"), mapping=Heartbeat(ts=now_ms(), engine_loaded=False).encode())
    ok, why = check_health(r, k, "w")
    assert not ok and "not loaded" in why
    r.hset(k.heartbeat("w"), mapping=Heartbeat(ts=now_ms(), engine_loaded=True, held=2).encode())
    ok, why = check_health(r, k, "w")
    assert ok and "held=2, draining=0" in why
    r.hset(k.heartbeat("w"), mapping=Heartbeat(ts=now_ms() - 60_000, engine_loaded=True,
                                               redis_error="OOM").encode())
    ok, why = check_health(r, k, "w")
    assert not ok and "old" in why and "waiting out a redis error: OOM" in why


def test_health_cli_exit_code_without_redis():
    out = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "health", "--worker-id", "x",
                          "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "unreachable" in out.stderr
