"""Benchmark: structured outputs' cost on the mixed workload, and what compiling a grammar costs.

``python -m benchmarks.structured [--model PATH] [--quick] [--rounds N]``

The workload is benchmarks.engine's (48 requests, prompts 16-384 random tokens, outputs
16-192, greedy). Run twice on one engine: unconstrained (``ignore_eos``, as benchmarks.engine
runs it) and with every request constrained by one JSON schema whose answers run long (an array
of at least 500 short strings: no answer can complete, so each runs to its ``max_tokens`` and
both runs produce exactly the same number of tokens). ``--rounds`` alternates the two so a
neighbour's load hits both alike; the best round of each is reported. Reported:

- output tokens/s of each (wall clock, and per CPU-second of this process) and their ratio
  (target >= 0.9);
- mask time per step from the engine's stats (``structured_mask_ms_per_step``), and per row;
- compile time of the schemas used: llguidance's tokenizer (once per engine), each schema
  cold (compiled and its first mask computed) and cached (a request's matcher from the cache).

Without ``--model`` the bench-size tiny checkpoint (32,000-token vocabulary) is written to
``.models/tiny-bench``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.engine import _bench_checkpoint, make_workload
from tokenrelay.engine.llm import LLM
from tokenrelay.engine.sampling_params import SamplingParams, StructuredOutputsParams

LONG_ANSWERS = {"type": "object", "additionalProperties": False, "required": ["items"],
                "properties": {"items": {"type": "array", "minItems": 500,
                                         "items": {"type": "string", "maxLength": 12}}}}
SCHEMAS = {
    "long array (the workload's)": LONG_ANSWERS,
    "record with enum, nesting, bounds": {
        "type": "object", "additionalProperties": False,
        "required": ["name", "age", "role", "address"],
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                       "address": {"type": "object", "required": ["city"],
                                   "properties": {"city": {"type": "string"},
                                                  "zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}}}}},
    "enum of 2000 values": {"enum": [f"value-{i}" for i in range(2000)]},
}


def run(llm: LLM, work: list, constrained: bool) -> dict[str, Any]:
    spec = StructuredOutputsParams(json=LONG_ANSWERS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=not constrained,
                             structured_outputs=spec if constrained else None)
              for _, m in work]
    before = llm.stats()
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = llm.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(m for _, m in work), "a request ended before its max_tokens"
    steps = after["structured_mask_steps"] - before["structured_mask_steps"]
    rows = after["structured_mask_rows"] - before["structured_mask_rows"]
    mask_s = after["structured_mask_seconds"] - before["structured_mask_seconds"]
    return {"tok_s": produced / elapsed, "cpu_tok_s": produced / cpu, "seconds": elapsed,
            "steps": after["num_steps"] - before["num_steps"], "mask_steps": steps,
            "mask_ms_per_step": 1000 * mask_s / steps if steps else 0.0,
            "mask_us_per_row": 1e6 * mask_s / rows if rows else 0.0,
            "mask_share": mask_s / elapsed}


def compile_times(llm: LLM) -> list[tuple[str, float, float]]:
    """(schema, cold ms, cached ms) on a fresh compiler (the engine's own has seen the
    workload's schema), after timing llguidance's tokenizer once."""
    from tokenrelay.engine.grammar import GrammarCompiler

    e = llm.engine
    compiler = GrammarCompiler(e.tokenizer, e.vocab_size, e.eos_token_ids, threads=1,
                               timeout_s=60)
    t0 = time.perf_counter()
    compiler._lltokenizer()
    print(f"llguidance tokenizer (once per engine): {1000 * (time.perf_counter() - t0):.1f} ms")
    out = []
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        compiler.submit(spec, [[]]).result()
        cold = time.perf_counter() - t0
        cached = []
        for _ in range(5):
            t0 = time.perf_counter()
            compiler.submit(spec, [[]]).result()
            cached.append(time.perf_counter() - t0)
        out.append((name, 1000 * cold, 1000 * statistics.median(cached)))
    compiler.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: build .models/tiny-bench)")
    ap.add_argument("--quick", action="store_true", help="16 requests, outputs 16-64")
    ap.add_argument("--rounds", type=int, default=2, help="alternated runs of each (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or _bench_checkpoint()
    llm = LLM(model, dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=1024,
              max_num_batched_tokens=2048)
    n, pr, orng = (16, (16, 128), (16, 64)) if args.quick else (48, (16, 384), (16, 192))
    work = make_workload(n, pr, orng, llm.engine.vocab_size, args.seed)
    print(f"model {model}  threads {torch.get_num_threads()}  {n} requests, prompts {pr}, "
          f"outputs {orng}: {sum(m for _, m in work)} output tokens")
    llm.generate([[5] * 32], SamplingParams(max_tokens=4))                  # warm-up
    llm.generate([[5] * 32], SamplingParams(max_tokens=4, structured_outputs=(
        StructuredOutputsParams(json=LONG_ANSWERS))))                    # compiles the schema
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for mode in ("unconstrained", "constrained"):
            r = run(llm, work, mode == "constrained")
            if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                best[mode] = r
    for mode, r in best.items():
        print(f"{mode:>14}: {r['tok_s']:8.1f} output tok/s  [{r['cpu_tok_s']:.1f} per "
              f"CPU-second]  ({r['seconds']:.1f} s, {r['steps']} steps)")
    u, c = best["unconstrained"], best["constrained"]
    print(f"throughput ratio constrained / unconstrained: {c['tok_s'] / u['tok_s']:.3f} wall, "
          f"{c['cpu_tok_s'] / u['cpu_tok_s']:.3f} per CPU-second  (target >= 0.9)")
    print(f"mask time: {c['mask_ms_per_step']:.3f} ms per step ({c['mask_steps']} steps), "
          f"{c['mask_us_per_row']:.1f} us per row, {100 * c['mask_share']:.1f}% of the run")
    for name, cold, cached in compile_times(llm):
        print(f"compile {name}: cold {cold:.2f} ms, cached {cached:.3f} ms")


if __name__ == "__main__":
    main()
