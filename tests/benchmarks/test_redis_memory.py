"""benchmarks.redis_memory on a small run: it really runs jobs and counts what they leave."""

from __future__ import annotations

import pytest

from benchmarks import redis_memory as bench_memory

pytestmark = pytest.mark.timeout(120)


def test_footprint_counts_each_jobs_keys_and_grows_with_streamed_tokens(redis_server):
    short = bench_memory.measure(redis_server.url, "fake:", 4, True, 6)
    long = bench_memory.measure(redis_server.url, "fake:", 64, True, 6)
    quiet = bench_memory.measure(redis_server.url, "fake:", 64, False, 6)
    assert (short.entries, long.entries, quiet.entries) == (6.0, 66.0, 2.0)
    for f in (short, long, quiet):     # one result stream, owner and dedupe record per job
        assert set(f.per_key) == {"result", "owner", "job"}, f.per_key
    assert long.per_key["result"] > short.per_key["result"]
    assert quiet.per_key["result"] < long.per_key["result"]


def test_main_prints_one_row_per_setting(capsys):
    assert bench_memory.main(["--model", "fake:", "--jobs", "3", "--tokens", "4",
                              "--node-bytes", "1024"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] == ["1024"]]
    assert [(r[1], r[2]) for r in rows] == [("4", "True"), ("4", "False")], rows
    assert all(float(r[-2]) > 1000 for r in rows), rows     # keys total, bytes per job
