"""A process that ran a worker on the real engine exits without nanobind's "leaked" pages.

The worker freezes its heap (gc.freeze) while it serves; frozen objects are never collected,
not even at exit, so triton's extension objects (imported by torch's compiler) used to outlive
their module and nanobind printed hundreds of "leaked" lines at every exit, the test run's too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures_redis import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import sys, threading
    from tokenrelay.engine import LLM
    from tokenrelay.worker.config import WorkerSettings
    from tokenrelay.worker.service import Worker
    llm = LLM(sys.argv[1], num_kv_blocks=32, max_model_len=256)
    w = Worker(WorkerSettings(redis_url=sys.argv[2], worker_id="clean-exit", model="fake:",
                              block_ms=50, heartbeat_ms=200), engine=llm.engine)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    assert w.ready.wait(60), "worker not ready"
    w.stop(force=True)
    t.join(30)
    print("worker stopped")
""")


@pytest.mark.timeout(180)
def test_worker_on_the_real_engine_exits_without_leak_reports(tiny_checkpoint, redis_server):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_checkpoint("llama")),
                           redis_server.url], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "worker stopped" in proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
