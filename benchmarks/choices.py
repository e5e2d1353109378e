"""Benchmark: what sharing KV blocks buys parallel sampling and beam search.

``python -m benchmarks.choices [--model PATH] [--prompt-tokens 200] [--max-tokens 128]``

One prompt of ``--prompt-tokens`` random token ids, ``--max-tokens`` output tokens (EOS
ignored). Printed, all measured unless marked "computed":

- KV blocks at the peak: one ``n = 4`` request (the prompt's blocks shared, the partial block
  copied on write) vs four separate requests with prefix caching off (each holds its own
  prompt); beam width 4 vs four beams that each held a private copy of the cache (computed:
  4 x the blocks of one full-length beam, what a cache copied per beam needs);
- time to first token of an ``n = 4`` request vs ``n = 1`` (median of ``--repeats``), measured
  through the step API from ``add_request`` to the step that returns the first token;
- output tokens/s of one ``n = 8`` request vs eight separate requests of the same prompt added
  together (prefix caching on: they arrive in one step, so each prefills the prompt itself).

Without ``--model`` the bench-size tiny checkpoint (``.models/tiny-bench``) is used.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from tokenrelay.engine.llm import LLM
from tokenrelay.engine.sampling_params import SamplingParams


def _llm(model: str, **kw: Any) -> LLM:
    llm = LLM(model, **kw)
    llm.generate([[5] * 32], SamplingParams(max_tokens=4))       # warm-up (compiles on CPU)
    return llm


def _sampling(n: int, max_tokens: int, seed: int = 0) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def peak_blocks(model: str, prompt: list[int], max_tokens: int) -> dict[str, int]:
    out: dict[str, int] = {}
    llm = LLM(model)
    llm.generate({"prompt_token_ids": prompt}, _sampling(4, max_tokens))
    out["n4_shared"] = llm.stats()["kv_blocks_peak"]
    llm = LLM(model, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": prompt}] * 4,
                 [_sampling(1, max_tokens, seed=i) for i in range(4)])
    out["n4_separate"] = llm.stats()["kv_blocks_peak"]
    from tokenrelay.engine.beam_search import BeamSearchParams
    llm = LLM(model)
    llm.beam_search({"prompt_token_ids": prompt},
                    BeamSearchParams(beam_width=4, max_tokens=max_tokens, ignore_eos=True))
    out["beam4_shared"] = llm.stats()["kv_blocks_peak"]
    out["beam4_private_computed"] = 4 * llm.engine.block_manager.blocks_for(
        len(prompt) + max_tokens - 1)
    return out


def time_to_first_token(llm: LLM, prompt: list[int], n: int, repeats: int) -> float:
    engine = llm.engine
    times = []
    for r in range(-1, repeats):            # round -1 warms the shapes up, untimed
        rid = f"ttft-{n}-{r}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, _sampling(n, 4))
        while not any(d.request_id == rid for d in engine.step()):
            pass
        if r >= 0:
            times.append(time.perf_counter() - start)
        engine.abort_request(rid)
    return statistics.median(times)


def _timed_run(llm: LLM, requests: list[tuple[str, SamplingParams]],
               prompt: list[int]) -> dict[str, float]:
    """Add ``requests`` at once and step to the end: seconds until every choice had its first
    token, seconds in all, and output tokens."""
    engine = llm.engine
    start = time.perf_counter()
    for rid, params in requests:
        engine.add_request(rid, prompt, params)
    want = sum(p.n for _, p in requests)
    seen: set[tuple[str, int]] = set()
    first_all = None
    tokens = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            seen.add((d.request_id, d.index))
            tokens += len(d.new_token_ids)
        if first_all is None and len(seen) == want:
            first_all = time.perf_counter() - start
    return {"first_s": first_all or 0.0, "total_s": time.perf_counter() - start,
            "tokens": tokens}


def throughput(llm: LLM, prompt: list[int], max_tokens: int) -> dict[str, dict[str, float]]:
    # Warm both shapes first (a batch size the compiled kernels have not seen recompiles).
    _timed_run(llm, [("w8", _sampling(8, 4))], prompt)
    _timed_run(llm, [(f"w{i}", _sampling(1, 4, seed=i)) for i in range(8)], prompt)
    one = _timed_run(llm, [("n8", _sampling(8, max_tokens))], prompt)
    eight = _timed_run(llm, [(f"r{i}", _sampling(1, max_tokens, seed=100 + i))
                             for i in range(8)], prompt)
    return {"n8": one, "eight": eight}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.choices",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: .models/tiny-bench)")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.engine import _bench_checkpoint
    model = args.model or _bench_checkpoint()
    vocab = LLM(model, num_kv_blocks=4).engine.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(5, vocab) for _ in range(args.prompt_tokens)]
    print(f"model {model}: prompt {len(prompt)} tokens, {args.max_tokens} output tokens")

    blocks = peak_blocks(model, prompt, args.max_tokens)
    print(f"KV blocks at peak, n=4:          shared {blocks['n4_shared']:5d}   "
          f"4 separate requests {blocks['n4_separate']:5d}   "
          f"({blocks['n4_separate'] / blocks['n4_shared']:.2f}x)")
    print(f"KV blocks at peak, beam width 4: shared {blocks['beam4_shared']:5d}   "
          f"private copies (computed) {blocks['beam4_private_computed']:5d}   "
          f"({blocks['beam4_private_computed'] / blocks['beam4_shared']:.2f}x)")

    llm = _llm(model)
    t1 = time_to_first_token(llm, prompt, 1, args.repeats)
    t4 = time_to_first_token(llm, prompt, 4, args.repeats)
    print(f"time to first token: n=1 {t1 * 1000:.1f} ms   n=4 {t4 * 1000:.1f} ms   "
          f"ratio {t4 / t1:.2f} (target <= 1.3)")

    tp = throughput(_llm(model, enable_prefix_caching=True), prompt, args.max_tokens)
    rate = {k: v["tokens"] / v["total_s"] for k, v in tp.items()}
    print(f"output tokens/s: one n=8 request {rate['n8']:.1f} ({tp['n8']['total_s']:.2f} s)   "
          f"eight requests {rate['eight']:.1f} ({tp['eight']['total_s']:.2f} s)   "
          f"ratio {rate['n8'] / rate['eight']:.2f} (target >= 1.5)")
    print(f"  until every choice had its first token (the prefill): n=8 "
          f"{tp['n8']['first_s'] * 1000:.1f} ms, eight requests "
          f"{tp['eight']['first_s'] * 1000:.1f} ms; the rest is decode, the same work per "
          f"step for both")


if __name__ == "__main__":
    main()
