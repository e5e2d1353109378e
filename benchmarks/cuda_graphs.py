"""Engine decode tokens/s on the triton backend, CUDA graphs off and on (CUDA only).

``python -m benchmarks.engine --cuda-graphs [--model PATH] [--graphs-batch 32] [--graphs-tokens 128]``

Why here and not in ``benchmarks.kernels``: this measures the engine (scheduler, model runner, the
graph runner of engine/layers/cuda_graphs.py) around the kernels, and ``kernels`` must not import
the engine. Each request gets a 64-token prompt; prefill is left out of the clock, which starts once
every request has its first token and stops when the last one finishes.
"""

from __future__ import annotations

import time

import torch

from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.sampling_params import SamplingParams

PROMPT_LEN = 64
BLOCK_SIZE = 16


def decode_tokens_per_s(model: str, batch: int, new_tokens: int, graphs: bool) -> float:
    """Decode tokens/s of ``batch`` greedy requests of ``new_tokens`` tokens each."""
    # An explicit pool size: memory of earlier runs stays in torch's cache, so "free memory"
    # would shrink from one engine to the next.
    blocks = batch * -(-(PROMPT_LEN + new_tokens + BLOCK_SIZE) // BLOCK_SIZE) + 64
    engine = LLMEngine.from_kwargs(model=model, dtype="bfloat16", attention_backend="triton",
                                   max_num_seqs=batch, enforce_eager=not graphs,
                                   num_kv_blocks=blocks, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (7 * i + j) % 500 for j in range(PROMPT_LEN)], params)
    started: set[str] = set()
    while len(started) < batch:                      # prefill: every request has its first token
        started |= {d.request_id for d in engine.step() if d.new_token_ids}
    torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def run(model: str, batch: int, new_tokens: int) -> int:
    """Print both figures; returns the exit status (2 without CUDA)."""
    if not torch.cuda.is_available():
        print("--cuda-graphs needs a CUDA device (CUDA graphs exist only there)")
        return 2
    for graphs in (False, True):
        tps = decode_tokens_per_s(model, batch, new_tokens, graphs)
        torch.cuda.empty_cache()
        print(f"engine decode, batch {batch}, CUDA graphs {'on ' if graphs else 'off'}: "
              f"{tps:8.0f} tokens/s")
    return 0
