"""Benchmark: our engine vs transformers static and continuous batching, on one mixed workload.

``python -m benchmarks.engine [--model PATH] [--quick] [--skip-hf]``
``python -m benchmarks.engine --cuda-graphs [--model PATH]``: decode tokens/s on the triton backend,
CUDA graphs off and on (CUDA only; benchmarks/cuda_graphs.py).

Workload: 48 requests, prompt lengths uniform in [16, 384], output lengths uniform in [16, 192]
(ignore_eos, greedy), random token ids; float32 on CPU by default. Reported:

- output tokens/s (wall clock, and per CPU-second of this process, which is steadier when
  other processes share the cores) of our engine, transformers static batching (batches of 8 in arrival order,
  left padding, each batch generating its longest request's length) and transformers
  continuous batching (``init_continuous_batching`` with per-request ``max_new_tokens``).
  Only the tokens each request asked for count, for every mode;
- peak KV utilization (tokens stored / slots allocated, at the step with most blocks in use);
- how many of the workload's sequences fit in the KV pool, paged vs a contiguous
  ``max_model_len`` preallocation of the same memory;
- time to first token for requests sharing a 256-token prefix, prefix caching on vs off
  (requests arrive one at a time after one warm-up request).

Without ``--model`` the bench-size tiny checkpoint is written to ``.models/tiny-bench``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenrelay.engine.llm import LLM
from tokenrelay.engine.sampling_params import SamplingParams

Workload = list[tuple[list[int], int]]


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> Workload:
    """Lengths come from their own generator, so the shape (and so every scheduling figure)
    is the same whatever the vocabulary size."""
    lengths = random.Random(seed)
    tokens = random.Random(seed + 1_000_003)
    shape = [(lengths.randint(*prompt_range), lengths.randint(*output_range)) for _ in range(n)]
    return [([tokens.randrange(5, vocab) for _ in range(p)], m) for p, m in shape]


def bench_engine(model: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    # Warm-up. On CUDA the whole workload runs once untimed: Triton compiles a kernel variant
    # the first time a shape class needs it (split or direct decode, prefill tiles), and on the
    # H200 that compile inside the timed run cut the 1.1B figure from ~21k to ~11.6k tok/s.
    if str(args.device).startswith("cuda"):
        llm.generate([p for p, _ in work], params)
    else:
        llm.generate([[5] * 32], SamplingParams(max_tokens=4))
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(m for _, m in work), "engine produced a wrong number of tokens"
    stats = llm.stats()
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {"tokens": produced, "seconds": elapsed, "tok_s": produced / elapsed,
            "cpu_tok_s": produced / cpu, "stats": stats, "ttft_median": statistics.median(ttft)}


def hf_dtype(args: argparse.Namespace) -> torch.dtype:
    """transformers runs in the engine's dtype (``--dtype``), so every side does the same math."""
    dtype = getattr(torch, str(args.dtype).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r}: name a torch dtype (float32, bfloat16, "
                         f"float16) so transformers can run in it too")
    return dtype


def bench_hf_static(model: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=hf_dtype(args)).to(args.device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    hf.generate(torch.tensor([[5] * 8], device=args.device), max_new_tokens=2, do_sample=False,
                pad_token_id=pad)   # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(work), args.hf_batch_size):
        batch = work[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch],
                            device=args.device)
        longest = max(m for _, m in batch)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                              min_new_tokens=longest, do_sample=False, eos_token_id=None,
                              pad_token_id=pad)
        assert out.shape[1] == width + longest
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(m for _, m in work)
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "cpu_tok_s": tokens / cpu}


def bench_hf_continuous(model: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=hf_dtype(args)).to(args.device).eval()
    cfg = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for j, (p, m) in enumerate(work):
            manager.add_request(p, request_id=f"r{j}", max_new_tokens=m, eos_token_id=-1)
        done: dict[str, Any] = {}
        while len(done) < len(work):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop died")
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        manager.stop(block=True, timeout=30)
    tokens = sum(len(r.generated_tokens) for r in done.values())
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "cpu_tok_s": tokens / cpu}


def capacity(work: Workload, num_blocks: int, block_size: int, max_model_len: int) -> dict[str, int]:
    """Sequences of this workload that fit at once: paged (each takes the blocks its full length
    needs, in arrival order) vs contiguous max_model_len slabs carved from the same memory."""
    paged, used = 0, 0
    for p, m in work * math.ceil(4 * num_blocks * block_size / max(1, sum(len(p) + m for p, m in work))):
        need = -(-(len(p) + m) // block_size)
        if used + need > num_blocks:
            break
        used += need
        paged += 1
    return {"paged": paged, "contiguous": (num_blocks * block_size) // max_model_len}


def bench_ttft(model: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    rng = random.Random(args.seed + 1)
    prefix = [rng.randrange(5, vocab) for _ in range(256)]
    prompts = [prefix + [rng.randrange(5, vocab) for _ in range(16)]
               for _ in range(args.ttft_requests + 1)]
    result = {}
    for caching in (True, False):
        llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  num_kv_blocks=256, enable_prefix_caching=caching)
        llm.generate([[7] * 300], SamplingParams(max_tokens=1))    # warm-up (unrelated)
        ttfts = []
        for p in prompts:
            out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0))[0]
            ttfts.append(out.metrics.time_to_first_token)
        result["on" if caching else "off"] = statistics.mean(ttfts[1:])   # first one warms
        if caching:
            result["hit_rate"] = llm.stats()["prefix_cache_hit_rate"]
    return result


def _bench_checkpoint() -> str:
    """The bench-size tiny checkpoint, written to ``.models/tiny-bench`` on first use."""
    from tokenrelay.engine.tiny import write_checkpoint
    out = Path(".models/tiny-bench")
    if not (out / "config.json").is_file():
        print(f"writing the bench-size tiny checkpoint to {out} ...")
        write_checkpoint(out, arch="llama", size="bench")
    return str(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: build .models/tiny-bench)")
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, prompts 16-128, outputs 16-64 (minutes less)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--ttft-requests", type=int, default=6)
    ap.add_argument("--skip-hf", action="store_true", help="only our engine (no comparison)")
    ap.add_argument("--skip-hf-cb", action="store_true",
                    help="skip transformers' continuous batching")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="instead: decode tokens/s on the triton backend, CUDA graphs off/on")
    ap.add_argument("--graphs-batch", type=int, default=32, help="requests (--cuda-graphs)")
    ap.add_argument("--graphs-tokens", type=int, default=128,
                    help="new tokens per request (--cuda-graphs)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = args.model or _bench_checkpoint()
    if args.cuda_graphs:
        from benchmarks import cuda_graphs as bench_graphs
        raise SystemExit(bench_graphs.run(model, args.graphs_batch, args.graphs_tokens))
    from tokenrelay.engine.model_config import ModelConfig
    vocab = ModelConfig.from_pretrained(model).vocab_size

    n, pr, orng = args.num_requests, (16, 384), (16, 192)
    if args.quick:
        n, pr, orng = min(n, 16), (16, 128), (16, 64)
    work = make_workload(n, pr, orng, vocab, args.seed)
    print(f"model {model}  threads {torch.get_num_threads()}  {n} requests, prompts {pr}, "
          f"outputs {orng}: {sum(len(p) for p, _ in work)} prompt / {sum(m for _, m in work)} "
          f"output tokens")

    ours = bench_engine(model, work, args)
    s = ours["stats"]
    print(f"\nengine:                 {ours['tok_s']:8.1f} output tok/s  "
          f"[{ours['cpu_tok_s']:.1f} per CPU-second]  ({ours['seconds']:.1f} s, "
          f"{s['num_steps']} steps, {s['num_preemptions']} preemptions, "
          f"peak {s['num_running_peak']} running)")
    print(f"peak KV utilization:    {100 * s['kv_utilization_peak']:.1f}% of allocated slots "
          f"hold tokens (at the step with most blocks in use: {s['kv_blocks_peak']} of "
          f"{s['kv_blocks_total']})  (target >= 96%)")
    cap = capacity(work, s["kv_blocks_total"], s["block_size"], args.max_model_len)
    print(f"sequences that fit in the pool ({s['kv_blocks_total'] * s['block_size']} token slots):"
          f" paged {cap['paged']} vs contiguous max_model_len={args.max_model_len} "
          f"preallocation {cap['contiguous']}  -> {cap['paged'] / max(1, cap['contiguous']):.1f}x "
          f"(target >= 3x)")
    tight = max(len(p) + m for p, m in work)
    print(f"  (contiguous at the workload's own longest request, {tight} tokens: "
          f"{(s['kv_blocks_total'] * s['block_size']) // tight} -> "
          f"{cap['paged'] / max(1, (s['kv_blocks_total'] * s['block_size']) // tight):.1f}x)")

    ttft = bench_ttft(model, args, vocab)
    print(f"TTFT, 256-token shared prefix + 16 own tokens: caching on {1000 * ttft['on']:.1f} ms,"
          f" off {1000 * ttft['off']:.1f} ms -> {ttft['off'] / ttft['on']:.1f}x faster "
          f"(target >= 3x; hit rate {100 * ttft['hit_rate']:.0f}%)")

    # transformers last: its continuous-batching manager runs a background thread.
    rows = []
    if not args.skip_hf:
        print()
        static = bench_hf_static(model, work, args)
        rows.append(("transformers static", static))
        print(f"transformers static:    {static['tok_s']:8.1f} output tok/s  "
              f"[{static['cpu_tok_s']:.1f} per CPU-second]  ({static['seconds']:.1f} s)")
        if not args.skip_hf_cb:
            try:
                cb = bench_hf_continuous(model, work, args)
                rows.append(("transformers continuous", cb))
                print(f"transformers continuous:{cb['tok_s']:8.1f} output tok/s  "
                      f"[{cb['cpu_tok_s']:.1f} per CPU-second]  ({cb['seconds']:.1f} s)")
            except Exception as exc:  # report, keep the rest of the bench
                print(f"transformers continuous: failed ({type(exc).__name__}: {exc})")
        if rows:
            best_name, best = max(rows, key=lambda r: r[1]["tok_s"])
            for name, r in rows:
                print(f"  speedup vs {name}: {ours['tok_s'] / r['tok_s']:.2f}x wall, "
                      f"{ours['cpu_tok_s'] / r['cpu_tok_s']:.2f}x per CPU-second")
            print(f"  speedup vs the better transformers mode ({best_name}): "
                  f"{ours['tok_s'] / best['tok_s']:.2f}x  (target >= 4x)")


if __name__ == "__main__":
    main()
