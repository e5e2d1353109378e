"""Gateway SSE streams ride out the failover of the master the gateway's ``--redis-url`` names
(issue #42: 12 of 25 such failovers broke 3-14 of 16 streams, which ended with
``redis_unavailable`` when ``--redis-retry-s`` ran out).

Three trials of ``benchmarks/failover.py`` (``python -m benchmarks.failover --trials 20`` runs
the many-trial version): 16 live streams on the three shards of a queue, node 0 SIGKILLed under
them, its replica takes over, node 0 comes back and takes its slots back, again. Every stream
must end whole, exact, with no error event. With redis-py's own routing (the URL's node asked
for XREAD's keys) the first trial broke 13 of 16 streams."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.failover import FailoverStack, run_trial

pytestmark = pytest.mark.timeout(420)


def test_streams_survive_killing_the_urls_node(tmp_path, request):
    stack = FailoverStack(tmp_path).start()
    request.addfinalizer(stack.stop)
    for trial in range(3):
        result = asyncio.run(run_trial(stack, trial, streams=16, tokens=300))
        assert result.broken == [], (trial, result.broken[:3], stack.log_dir)
