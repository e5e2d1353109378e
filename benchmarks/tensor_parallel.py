"""Benchmark: one model split over two ranks (tensor parallelism) vs one rank, same cores.

``python -m benchmarks.tensor_parallel [--model PATH] [--threads 2] [--quick] [--rounds N]``

The mixed workload of ``benchmarks.engine`` (48 requests, prompts 16-384 tokens, outputs
16-192, greedy, all submitted at once; bench-size tiny checkpoint by default), run by

- size 1 with ``--threads`` torch threads, and
- size 2 with ``--threads / 2`` threads per rank (rank 0 here, rank 1 a spawned process; gloo
  on CPU, NCCL on CUDA with ``--device cuda``),

alternating when ``--rounds`` > 1 so a busy host's slow moments fall on both. Reported per
size: output tokens/s; time to first token over the batch (median, p90: queueing included);
one request alone (TTFT of a 256-token prompt, then time per output token); and for size 2 the
time rank 0 spends inside collectives per step, by kind (the forward's all-reduces, the
logits gather, the step broadcast to rank 1), timed around ``ParallelGroup``'s calls in this
process. That time is transfer plus waiting for the other rank to arrive, so it bounds the
communication cost from above; the floor is measured apart: the same collectives of one decode
step (same shapes, same group class) between two otherwise idle processes, no compute.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from benchmarks.engine import _bench_checkpoint, make_workload
from tokenrelay.engine.llm import LLM
from tokenrelay.engine.parallel.group import ParallelGroup, Rendezvous, open_store
from tokenrelay.engine.sampling_params import SamplingParams

COMM: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])      # kind -> [seconds, calls]


def _timed(kind: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            COMM[kind][0] += time.perf_counter() - start
            COMM[kind][1] += 1
    return wrapper


def time_collectives() -> None:
    """Count the time rank 0 (this process) spends in each kind of collective."""
    ParallelGroup.all_reduce = _timed("all-reduce", ParallelGroup.all_reduce)
    ParallelGroup.gather_vocab = _timed("logits gather", ParallelGroup.gather_vocab)
    ParallelGroup.broadcast_control = _timed("step broadcast", ParallelGroup.broadcast_control)


def _one_step(group: ParallelGroup, rows: int, hidden: int, layers: int, vocab: int) -> None:
    """The collectives of one decode step of ``rows`` sequences, without the compute."""
    group.broadcast_control(torch.zeros(9, dtype=torch.int64))
    group.broadcast_control(torch.zeros(7 * rows + 1, dtype=torch.int64))
    group.all_reduce(torch.ones(rows, hidden))                  # embedding
    for _ in range(2 * layers):                                 # o_proj, down_proj
        group.all_reduce(torch.ones(rows, hidden))
    group.gather_vocab(torch.ones(rows, -(-vocab // 2)), vocab)


def _peer(port: int, iters: int, shape: tuple[int, int, int, int]) -> None:
    torch.set_num_threads(1)
    store, _ = open_store(Rendezvous("127.0.0.1", port, 60.0), 2, 60.0)
    group = ParallelGroup(store, 1, 2, torch.device("cpu"), 60.0)
    for _ in range(iters):
        _one_step(group, *shape)


def collective_floor(rows: int, hidden: int, layers: int, vocab: int,
                     iters: int = 50) -> float:
    """Seconds per decode step spent in collectives alone (two idle processes, 1 thread)."""
    store, rendezvous = open_store(None, 2, 60.0)
    ctx = multiprocessing.get_context("spawn")
    shape = (rows, hidden, layers, vocab)
    peer = ctx.Process(target=_peer, args=(rendezvous.port, iters + 5, shape), daemon=True)
    peer.start()
    try:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        group = ParallelGroup(store, 0, 2, torch.device("cpu"), 60.0)
        for _ in range(5):
            _one_step(group, *shape)
        start = time.perf_counter()
        for _ in range(iters):
            _one_step(group, *shape)
        return (time.perf_counter() - start) / iters
    finally:
        torch.set_num_threads(previous)
        peer.join(30)


def run(model: str, size: int, threads: int, work: list, args: argparse.Namespace
        ) -> dict[str, Any]:
    torch.set_num_threads(threads)          # size 2 splits it: threads // 2 per rank
    llm = LLM(model, dtype=args.dtype, device=args.device, tensor_parallel_size=size,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        per_rank = torch.get_num_threads()
        llm.generate([[5] * 32], SamplingParams(max_tokens=4))         # warm-up
        COMM.clear()
        steps0 = llm.stats()["num_steps"]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params)
        elapsed = time.perf_counter() - start
        steps = llm.stats()["num_steps"] - steps0
        comm = {k: (v[0], v[1]) for k, v in COMM.items()}
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft = sorted(o.metrics.time_to_first_token for o in outs)
        alone = single_request(llm, args)
    finally:
        llm.shutdown()
    return {"size": size, "threads": per_rank, "tok_s": produced / elapsed, "seconds": elapsed,
            "steps": steps, "ttft_median": statistics.median(ttft),
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "comm": comm, **alone}


def single_request(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    """One request on an idle engine: TTFT of a 256-token prompt, then per output token."""
    prompt = [7 + (i * 31) % 900 for i in range(256)]
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    n = args.alone_tokens
    full = llm.generate([prompt[::-1]], SamplingParams(max_tokens=n, temperature=0.0,
                                                        ignore_eos=True))[0]
    m = full.metrics
    return {"alone_ttft": first.metrics.time_to_first_token,
            "alone_tpot": (m.finished_time - m.first_token_time) / (n - 1)}


def report(r: dict[str, Any]) -> None:
    print(f"size {r['size']} ({r['threads']} thread{'s' if r['threads'] > 1 else ''} per rank): "
          f"{r['tok_s']:7.1f} output tok/s ({r['seconds']:.1f} s, {r['steps']} steps); "
          f"TTFT median {1000 * r['ttft_median']:.0f} ms, p90 {1000 * r['ttft_p90']:.0f} ms; "
          f"alone: TTFT {1000 * r['alone_ttft']:.1f} ms, {1000 * r['alone_tpot']:.1f} ms per "
          f"output token")
    if not r["comm"]:
        return
    total = sum(s for s, _ in r["comm"].values())
    parts = ", ".join(f"{k} {1000 * s / r['steps']:.2f} ms ({c / r['steps']:.0f} calls)"
                      for k, (s, c) in sorted(r["comm"].items()))
    print(f"    rank 0 in collectives per step: {1000 * total / r['steps']:.2f} ms of "
          f"{1000 * r['seconds'] / r['steps']:.2f} ms ({100 * total / r['seconds']:.0f}%): {parts}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: build .models/tiny-bench)")
    ap.add_argument("--threads", type=int, default=2, help="threads of size 1 (size 2: half "
                    "each)")
    ap.add_argument("--quick", action="store_true", help="16 requests, shorter prompts/outputs")
    ap.add_argument("--rounds", type=int, default=1, help="alternate size 1 / size 2 N times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--alone-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    model = args.model or _bench_checkpoint()
    from tokenrelay.engine.model_config import ModelConfig
    vocab = ModelConfig.from_pretrained(model).vocab_size
    n, pr, orng = 48, (16, 384), (16, 192)
    if args.quick:
        n, pr, orng = 16, (16, 128), (16, 64)
    work = make_workload(n, pr, orng, vocab, args.seed)
    print(f"model {model}  {n} requests, prompts {pr}, outputs {orng}: "
          f"{sum(len(p) for p, _ in work)} prompt / {sum(m for _, m in work)} output tokens; "
          f"{args.threads} threads in all")
    cfg = ModelConfig.from_pretrained(model)
    for rows in (1, 48):
        floor = collective_floor(rows, cfg.hidden_size, cfg.num_hidden_layers, vocab)
        print(f"collectives of one decode step of {rows} sequences, no compute "
              f"({2 * cfg.num_hidden_layers + 1} all-reduces of [{rows}, {cfg.hidden_size}], "
              f"a gather of [{rows}, {-(-vocab // 2)}], 2 step broadcasts): "
              f"{1000 * floor:.2f} ms")
    time_collectives()
    results: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for size in (1, 2):
            r = run(model, size, args.threads, work, args)
            results[size].append(r)
            report(r)
    if args.rounds > 1:
        for size, rs in results.items():
            best = max(rs, key=lambda r: r["tok_s"])
            print(f"size {size} best of {args.rounds}: {best['tok_s']:.1f} tok/s, median "
                  f"{statistics.median(r['tok_s'] for r in rs):.1f}")


if __name__ == "__main__":
    main()
