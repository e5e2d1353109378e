"""``python -m benchmarks.affinity`` runs end to end with tiny sizes (no timing is asserted:
the figures depend on the machine). What is asserted holds whatever the load: with routing
keys every turn after the first ran on the worker of the turn before it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


def test_bench_affinity_smoke(tiny_llama):
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.affinity", "--model", str(tiny_llama),
         "--conversations", "4", "--turns", "3", "--system-tokens", "32", "--user-tokens", "8",
         "--output-tokens", "4", "8", "--think-s", "0.02", "--enforce-eager",
         "--max-model-len", "512", "--num-kv-blocks", "256", "--timeout", "120", "--rounds", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("1 ")]
    key = [r for r in rows if r[1] == "key"]
    assert len(rows) == 2 and len(key) == 1, res.stdout
    assert float(key[0][9]) == 1.0                  # same worker as the previous turn, always
    assert 0.0 <= float(key[0][2]) <= 1.0           # prefix-cache hit rate
    assert "with routing keys: prefix-cache hit rate" in res.stdout
