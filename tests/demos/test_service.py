"""``make demo``'s program (``python -m demos.service``) end to end on the tiny model: a worker,
two streamed answers, a batch through the queue, the stats, a clean shutdown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT


@pytest.mark.timeout(300)
def test_demo_runs_end_to_end_on_the_tiny_model(redis_server):
    proc = subprocess.run([sys.executable, "-m", "demos.service", "--tiny", "--batch-lines", "20",
                           "--redis-url", redis_server.url], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("streaming:") == 2 and out.count("tokens in") == 2, out[-3000:]
    assert "'succeeded': 20" in out and "'failed': 0" in out, out[-3000:]
    assert "done: worker stopped, demo keys deleted" in out
    assert "Traceback" not in out
