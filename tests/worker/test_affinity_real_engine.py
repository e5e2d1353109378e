"""Prefix affinity on the real engine: turn 2 of a conversation, sent with the routing key of
turn 1, runs on turn 1's worker and reads turn 1's prompt and output from that engine's prefix
cache (its stats count the hits); the other worker's engine sees nothing of it. Two in-process
workers, each with its own engine on the tiny random-weight checkpoint (CPU)."""

from __future__ import annotations

import importlib.util

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.core.affinity import rank
from tokenrelay.protocol.keys import Keys
from tests.fault_harness import read_events
from tests.sdk_helpers import RealWorker

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(importlib.util.find_spec("tokenrelay.engine.llm_engine") is None,
                                 reason="engine.llm_engine not available")]

ENGINE_KW = dict(kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    from tokenrelay.engine.llm import LLM
    path = str(tiny_checkpoint("llama"))
    return {w: LLM(path, **ENGINE_KW).engine for w in ("ra", "rb")}


def test_turn_two_hits_the_prefix_cache_of_turn_ones_worker(redis_server, engines):
    workers = [RealWorker(redis_server.url, eng, worker_id=w).start()
               for w, eng in engines.items()]
    try:
        key = "conversation-1"
        home = rank(key, list(engines))[0]
        other = next(w for w in engines if w != home)
        system = [(7 * i) % 1000 + 3 for i in range(160)]      # a long shared start
        before = {w: dict(e.stats()) for w, e in engines.items()}
        with Client(redis_server.url) as c:
            turn1 = c.submit(prompt_token_ids=system, routing_key=key, max_tokens=12,
                             temperature=0, ignore_eos=True)
            out1 = turn1.result(timeout=120).outputs[0].token_ids
            mid = {w: dict(e.stats()) for w, e in engines.items()}
            prompt2 = system + list(out1) + [11, 12, 13, 14, 15]
            turn2 = c.submit(prompt_token_ids=prompt2, routing_key=key, max_tokens=4,
                             temperature=0, ignore_eos=True)
            turn2.result(timeout=120)
        after = {w: dict(e.stats()) for w, e in engines.items()}
    finally:
        for w in workers:
            w.stop()
    r = redis_server.client()
    assert [e.worker_id for e in read_events(r, Keys(), turn2.id) if e.type == "started"] == [home]
    block = int(after[home]["block_size"])
    hits = after[home]["prefix_cache_hit_tokens"] - mid[home]["prefix_cache_hit_tokens"]
    # every full block of turn 1's prompt and output (its last token has no KV yet)
    assert hits >= (len(system) + len(out1) - 1) // block * block > 0
    assert hits / len(prompt2) >= 0.9
    assert after[other]["prefix_cache_query_tokens"] == before[other]["prefix_cache_query_tokens"]
