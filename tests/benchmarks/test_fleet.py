"""The fleet benchmark runs end to end at tiny sizes on both backends (one redis-server, and a
3-master cluster with a 3-shard queue) and reports what it measured; the figures themselves
are for the README, never asserted as timings here."""

from __future__ import annotations

import json

import pytest

from benchmarks import fleet as bench_fleet


@pytest.mark.timeout(240)
def test_bench_fleet_smoke(tmp_path, capsys):
    bench_fleet.main(["--workers", "1", "--jobs", "30", "--max-tokens", "4",
                      "--max-num-seqs", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "one redis-server" in out and "cluster 3m, 3 shards" in out
    rows = json.loads((tmp_path / "fleet.json").read_text())["rows"]
    assert [(r["backend"], r["workers"], r["shards"]) for r in rows] == [
        ("one redis-server", 1, 1), ("cluster 3m, 3 shards", 1, 3)]
    for r in rows:
        assert r["jobs_s"] > 0 and r["tokens_s"] == pytest.approx(r["jobs_s"] * 4)
        assert len(r["server_cores"]) == r["masters"] and r["busiest_cores"] >= 0
