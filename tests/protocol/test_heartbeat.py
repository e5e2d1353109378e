"""protocol/heartbeat.py: the worker heartbeat's one schema. Its field names are wire names
(docs/protocol.md lists them; other versions of workers and producers read them), its encoding
is what HSET stores, and reading is lenient."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokenrelay.protocol.heartbeat import FIELDS, INSTANCE_FIELD, Heartbeat
from tests.import_boundaries import ROOT, package_files

pytestmark = pytest.mark.timeout(60)


def test_field_names_are_the_documented_wire_names():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## Workers: heartbeat"):]
    section = section[:section.index("\n* Ownership")]
    documented = set(re.findall(r"`([a-z_]+)`", section)) & set(FIELDS)
    assert documented == set(FIELDS), set(FIELDS) - documented
    assert INSTANCE_FIELD == "instance"


def test_encode_writes_integers_and_flags_and_leaves_the_lease_field_alone():
    beat = Heartbeat(ts=5, instance="h:1:t", pid=7, host="h", queue="q", engine_loaded=True,
                     draining=False, held=3, redis_error="", affinity=True, affinity_queued=2)
    out = beat.encode()
    assert INSTANCE_FIELD not in out and set(out) == set(FIELDS) - {INSTANCE_FIELD}
    assert (out["engine_loaded"], out["draining"], out["affinity"]) == (1, 0, 1)
    assert all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in out.values())


def test_decode_reads_back_what_encode_wrote_as_redis_returns_it():
    beat = Heartbeat(ts=1700000000123, pid=42, host="box", queue="q", model="/m",
                     served_model_name="alpha", started_ms=99, engine_loaded=True,
                     draining=True, held=3, running=2, waiting=1, redis_error="OOM x",
                     affinity=True, affinity_queued=4)
    raw = {k.encode(): str(v).encode() for k, v in beat.encode().items()}
    assert Heartbeat.decode(raw) == beat
    row = [raw.get(f.encode()) for f in FIELDS]
    assert Heartbeat.from_row(row) == beat
    assert Heartbeat.decode({INSTANCE_FIELD: "h:1:t"}).instance == "h:1:t"   # str keys too


def test_reading_is_lenient_and_a_gone_hash_is_none():
    assert Heartbeat.from_row([None] * len(FIELDS)) is None
    assert Heartbeat.from_row(None) is None
    odd = Heartbeat.decode({b"ts": b"soon", b"held": b"-", b"engine_loaded": b"yes",
                            b"draining": b"2", b"unknown": b"x"})
    assert (odd.ts, odd.held, odd.engine_loaded, odd.draining) == (0, 0, False, False)
    assert Heartbeat.decode({}) == Heartbeat()


@pytest.mark.parametrize("beat,queue,serving", [
    (Heartbeat(queue="q", engine_loaded=True), "q", True),
    (Heartbeat(queue="q", engine_loaded=True, draining=True), "q", False),
    (Heartbeat(queue="q"), "q", False),                      # engine not loaded (or failed)
    (Heartbeat(queue="other", engine_loaded=True), "q", False),
])
def test_serving_is_what_the_listing_and_the_router_call_live(beat, queue, serving):
    assert beat.serving(queue) is serving


def test_no_heartbeat_field_is_named_by_hand_outside_the_contract():
    """A field only the heartbeat has, as a string literal in the worker or the SDK, would be a
    second home for it (the real readers and the writer are tested through the schema)."""
    own = {"engine_loaded", "affinity_queued", INSTANCE_FIELD, "started_ms", "redis_error"}
    found = []
    for package in ("worker", "producer_sdk"):
        for path in package_files(package):
            for node in ast.walk(ast.parse(Path(path).read_text())):
                if isinstance(node, ast.Constant) and node.value in own:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert found == []
