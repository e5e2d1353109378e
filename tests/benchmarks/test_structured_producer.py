"""benchmarks.structured_producer on a small run: it measures every row it names."""

from __future__ import annotations

import pytest

from benchmarks import structured_producer as bench

pytestmark = pytest.mark.timeout(120)


def test_main_prints_every_measurement(capsys):
    assert bench.main(["--jobs", "20", "--rounds", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 10
    assert all(float(r.split()[-2 if r.endswith("us") else -3]) > 0 for r in rows), rows
