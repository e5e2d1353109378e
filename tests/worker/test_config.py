"""worker/config.py: the worker's settings, from flags over env vars over defaults."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import PARKING_CONSUMER
from tokenrelay.protocol.settings import settings_from_args
from tokenrelay.worker.config import WorkerSettings, build_parser


def test_parking_consumer_is_not_a_valid_worker_id():
    with pytest.raises(ValueError):
        WorkerSettings(worker_id=PARKING_CONSUMER)


def test_settings_from_env_and_flags(monkeypatch):
    monkeypatch.setenv("TOKENRELAY_QUEUE", "fromenv")
    monkeypatch.setenv("TOKENRELAY_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("TOKENRELAY_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("TOKENRELAY_KV_CACHE_MEMORY_BYTES", "1GiB")
    s = settings_from_args(build_parser().parse_args(["--model", "m", "--max-num-seqs", "3",
                                                      "--redis-url", "rediss://u:p@h:1/2"]))
    assert s.queue == "fromenv" and s.max_num_seqs == 3 and s.enable_prefix_caching is False
    assert s.kv_cache_memory_bytes == 2**30 and s.redis_url == "rediss://u:p@h:1/2"
    kw = s.engine_kwargs()
    assert kw["model"] == "m" and kw["max_num_seqs"] == 3 and "block_size" not in kw
    s2 = settings_from_args(build_parser().parse_args(["--enable-prefix-caching"]))
    assert s2.enable_prefix_caching is True


def test_sizes_are_parsed_by_pydantic_bytesize():
    s = WorkerSettings(kv_cache_memory_bytes="2GiB", max_payload_bytes="4MiB",
                       dead_letter_payload_bytes="64KB")
    assert s.kv_cache_memory_bytes == 2 * 2**30 and s.max_payload_bytes == 4 * 2**20
    assert s.dead_letter_payload_bytes == 64_000
    assert WorkerSettings(kv_cache_memory_bytes="512MB").kv_cache_memory_bytes == 512 * 10**6
    assert WorkerSettings(kv_cache_memory_bytes=123).kv_cache_memory_bytes == 123
    assert s.decode_limits().max_payload_bytes == 4 * 2**20
    with pytest.raises(ValueError):
        WorkerSettings(kv_cache_memory_bytes="lots")


def test_default_worker_id_is_stable():
    a = WorkerSettings(device="cuda:1").resolved_worker_id()
    assert a == WorkerSettings(device="cuda:1").resolved_worker_id() and a.endswith("-cuda1")


def test_result_ttl_in_ms_is_the_flag_in_seconds():
    assert WorkerSettings(result_ttl=1.5).result_ttl_ms == 1500


def test_engine_time_bounds_are_worker_settings():
    """A frozen tensor-parallel rank holds the worker no longer than its lease unless told
    (issue #42: gloo's 120 s); the grammar compiler's threads and time bound are flags too."""
    kw = settings_from_args(build_parser().parse_args(["--model", "m", "--lease-ms", "8000"])
                            ).engine_kwargs()
    assert kw["tensor_parallel_timeout"] == 4.0     # half the lease: wait and exit fit in it
    assert "grammar_compile_threads" not in kw and "grammar_compile_timeout_s" not in kw
    kw = settings_from_args(build_parser().parse_args(
        ["--model", "m", "--tensor-parallel-timeout-s", "45", "--grammar-compile-threads", "3",
         "--grammar-compile-timeout-s", "2.5"])).engine_kwargs()
    assert kw["tensor_parallel_timeout"] == 45.0
    assert kw["grammar_compile_threads"] == 3 and kw["grammar_compile_timeout_s"] == 2.5
    from tokenrelay.engine.config import EngineConfig
    assert {"tensor_parallel_timeout", "grammar_compile_threads",
            "grammar_compile_timeout_s"} <= set(EngineConfig.__dataclass_fields__)
