"""``observe_many`` is ``observe`` repeated: the same buckets, count and sum exported."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tokenrelay.worker.metrics import observe_many

BUCKETS = (0.001, 0.005, 0.01, 0.1)


def _samples(h: Histogram) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for m in h.collect() for s in m.samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("values", [[(0.004, 3)], [(0.0005, 1), (0.02, 7), (5.0, 2)],
                                    [(0.005, 4), (0.001, 0)]])
def test_observe_many_equals_repeated_observe(values):
    one = Histogram("one", "per observation", buckets=BUCKETS, registry=CollectorRegistry())
    many = Histogram("many", "batched", buckets=BUCKETS, registry=CollectorRegistry())
    for value, count in values:
        for _ in range(count):
            one.observe(value)
        observe_many(many, value, count)
    got = {(n.replace("many", "one"), le): v for (n, le), v in _samples(many).items()}
    assert got.keys() == _samples(one).keys()
    for k, v in _samples(one).items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
