"""How big the KV pool is: ``gpu_memory_utilization`` as vLLM means it (this engine's share of
the card, whatever other processes hold), and the CPU default that fits a laptop."""

from __future__ import annotations

import pytest

from tokenrelay.engine.config import (CPU_DEFAULT_KV_CACHE_BYTES, CudaMemory, EngineConfig,
                           gpu_kv_budget)

GiB = 1024**3


def test_two_workers_on_one_card_each_get_their_share():
    """80 GiB card; worker A (0.45) loaded 10 GiB of weights and took a 24 GiB pool; worker B
    (0.45) then loads the same weights: it must get A's pool size again, not what A left of
    0.9 (counting A's memory as its own gave B nothing)."""
    total, act = 80 * GiB, 1 * GiB
    a_before = CudaMemory(total, free=79 * GiB, reserved=0)
    a_after = CudaMemory(total, free=69 * GiB, reserved=10 * GiB)
    a_pool = gpu_kv_budget(0.45, a_before, a_after, act)
    assert a_pool == int(80 * GiB * 0.45) - 10 * GiB - act
    # A allocated its pool: free memory dropped by it.
    b_before = CudaMemory(total, free=69 * GiB - a_pool, reserved=0)
    b_after = CudaMemory(total, free=b_before.free - 10 * GiB, reserved=10 * GiB)
    assert gpu_kv_budget(0.45, b_before, b_after, act) == a_pool


def test_memory_outside_torch_counts_and_the_pool_never_exceeds_what_is_free():
    total = 16 * GiB
    before = CudaMemory(total, free=15 * GiB, reserved=0)
    # 2 GiB of weights in torch's allocator, 0.5 GiB of library workspaces outside it
    after = CudaMemory(total, free=int(12.5 * GiB), reserved=2 * GiB)
    assert gpu_kv_budget(0.9, before, after, 0) == int(16 * GiB * 0.9) - int(2.5 * GiB)
    # another process holds most of the card: only what is free is offered
    crowded = CudaMemory(total, free=3 * GiB, reserved=2 * GiB)
    assert gpu_kv_budget(0.9, CudaMemory(total, free=5 * GiB, reserved=0), crowded,
                         GiB // 2) == 3 * GiB - GiB // 2


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_is_a_fraction(tiny_llama, value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model=str(tiny_llama), device="cpu", gpu_memory_utilization=value).resolve()


def test_cpu_pool_defaults_to_a_laptop_budget_and_the_byte_setting_wins(tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama), device="cpu", max_num_seqs=100_000).resolve()
    assert cfg.num_kv_blocks_for(None) == CPU_DEFAULT_KV_CACHE_BYTES // cfg.kv_block_bytes()
    assert CPU_DEFAULT_KV_CACHE_BYTES <= 1024**3
    cfg = EngineConfig(model=str(tiny_llama), device="cpu",
                       kv_cache_memory_bytes=64 * cfg.kv_block_bytes()).resolve()
    assert cfg.num_kv_blocks_for(None) == 64 and cfg.num_kv_blocks_for(10 * GiB) == 64


def test_the_worker_passes_gpu_memory_utilization_to_the_engine(monkeypatch):
    from tokenrelay.worker.config import WorkerSettings
    monkeypatch.setenv("TOKENRELAY_GPU_MEMORY_UTILIZATION", "0.45")
    kw = WorkerSettings(model="m").engine_kwargs()
    assert kw["gpu_memory_utilization"] == 0.45
    monkeypatch.delenv("TOKENRELAY_GPU_MEMORY_UTILIZATION")
    assert "gpu_memory_utilization" not in WorkerSettings(model="m").engine_kwargs()
    with pytest.raises(ValueError):
        WorkerSettings(model="m", gpu_memory_utilization=1.2)
