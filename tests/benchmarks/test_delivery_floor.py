"""benchmarks.delivery_floor on a tiny model: the writer really runs the engine alone and writes
one event per step; the reader counts one delay per token, so the floor's percentiles are over
as many samples as the worker benchmark's (one per token event)."""

from __future__ import annotations

import re
import time

import pytest

from benchmarks import delivery_floor as floor
from benchmarks.worker import build_parser, workload

pytestmark = pytest.mark.timeout(240)


def test_the_floor_has_one_delay_per_token_the_engine_made(tiny_llama, capsys):
    argv = ["--model", str(tiny_llama), "--quick", "--num-requests", "3", "--max-num-seqs", "4",
            "--enforce-eager"]
    _, _, work = workload(build_parser().parse_args(argv))
    assert floor.main(argv) == 0
    out = capsys.readouterr().out
    m = re.search(r"delivery floor +: p50 ([\d.]+) ms +p99 ([\d.]+) ms +max ([\d.]+) ms over "
                  r"(\d+) tokens", out)
    assert m, out
    p50, p99, worst, tokens = float(m[1]), float(m[2]), float(m[3]), int(m[4])
    assert tokens == sum(w.max_tokens for w in work)      # ignore_eos: every token was made
    assert 0 < p50 <= p99 <= worst < 10_000
    m = re.search(r"wake-up floor +: p50 ([\d.]+) ms +p99 ([\d.]+) ms +max ([\d.]+) ms over "
                  r"(\d+) PINGs, each after ([\d.]+) ms of silence", out)
    assert m, out
    assert 0 < float(m[1]) <= float(m[2]) <= float(m[3]) and int(m[4]) == floor.WAKE_PINGS
    lo, hi = floor.WAKE_GAP_S       # the engine's median step, bounded
    assert lo * 1000 <= float(m[5]) <= hi * 1000


def test_the_wake_probe_times_each_ping_after_its_silence(redis_server):
    t0 = time.perf_counter()
    rtts = floor.wake_probe(redis_server.url, 0.02, 5)
    took = time.perf_counter() - t0
    assert len(rtts) == 5 and all(0 < r < 1 for r in rtts)
    assert took >= 5 * 0.02 + sum(rtts) * 0.99     # every PING waited its silence out first


def test_the_reader_weighs_an_event_by_its_tokens():
    reader = floor.floor_reader("redis://127.0.0.1:1/0")
    key = next(iter(reader.last))
    # an event as the reader takes it: the raw msgpack map, as the SDK reads it
    reader._event(key, {"type": "token", "ts": 100.0, "token_ids": [5, 5, 5]}, 100.002)
    assert len(reader.delays) == 3 and reader.tokens == 3
    assert all(abs(d - 0.002) < 1e-9 for d in reader.delays)
