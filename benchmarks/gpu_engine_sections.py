"""The GPU check's engine sections (issue #37): CUDA graphs against eager, how busy the engine
keeps the GPU, and the engine against transformers on a 1.1B Llama-shaped checkpoint. Each
takes the check's ``Plan`` and returns an ``Outcome``; a dry run (CPU, tiny model) runs every
line at toy sizes.

The 1.1B checkpoint has TinyLlama's shape (``engine.tiny`` size ``1b``) with random weights,
written in bfloat16 on the GPU machine, so nothing has to travel there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:       # gpu_check_sections imports this module to list its sections
    from benchmarks.gpu_check_sections import Outcome, Plan

BUSY_TARGET = 0.85                 # GPU kernel time / wall time while decoding
SPEED_TARGET_X, SPEED_TARGET_TOK_S, STREAM_TARGET_MS = 20.0, 20_000.0, 1.0


def one_b_model(plan: Plan) -> Path:
    """The 1.1B Llama-shaped bf16 checkpoint on CUDA; the tiny model in a dry run."""
    if plan.dry:
        return plan.tiny_model("llama")
    key = "llama-1b-bf16"
    if key not in plan.tiny:
        from tokenrelay.engine.tiny import write_checkpoint
        plan.tiny[key] = write_checkpoint(plan.workdir / "models" / key, arch="llama",
                                          size="1b", dtype="bfloat16")
    return plan.tiny[key]


def _dtype(plan: Plan) -> str:
    return "float32" if plan.dry else "bfloat16"


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- cuda_graphs -------------------------------------------------------------------------
def _greedy(model: str, eager: bool, dtype: str, prompts: list[list[int]]) -> list[Any]:
    from tokenrelay.engine import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, device="cuda", attention_backend="triton",
              enforce_eager=eager, max_num_seqs=8, num_kv_blocks=256)
    captured = llm.engine.model_runner.decode_graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.shutdown()
    del llm
    _free("cuda")
    return [captured, outs]


def _explained(graph: Any, eager: Any, tol: float) -> tuple[bool, float]:
    """Every logprob of the graphs' tokens within ``tol`` of eager's up to the first
    different token, and that one explained: eager's top two were within ``tol``. Returns
    (ok, the largest logprob difference seen)."""
    worst = 0.0
    for pos, (tg, te) in enumerate(zip(graph.token_ids, eager.token_ids)):
        lg, le = graph.logprobs[pos], eager.logprobs[pos]
        if tg != te:
            top = sorted(le.values(), reverse=True)
            return len(top) > 1 and top[0] - top[1] <= tol, worst
        worst = max(worst, abs(lg[tg] - le[te]))
        if worst > tol:
            return False, worst
    return True, worst


def _shape_spread(eager8: list[Any], eager6: list[Any]) -> float:
    """How far eager bf16 moves from itself when only the batch's shape changes (the same
    prompts decoded 6 and 8 at a time): the largest logprob difference up to each prompt's
    first different token. In bf16 every GEMM output is rounded to 8 significant bits and
    cuBLAS picks its kernel (tiles, split-K: the order of the sums) by shape, so this much
    difference carries no information about correctness."""
    return max(_explained(a, b, float("inf"))[1] for a, b in zip(eager6, eager8))


def cuda_graphs(plan: Plan) -> Outcome:
    """Decode through captured CUDA graphs against the eager path. 8 prompts with
    ``max_num_seqs`` 8: every decode step replays the size-8 graph unpadded and eager runs
    the same 8-row GEMMs, so the comparison is not batch-shape sensitive (the 16:32 run
    compared 6 prompts, padded to 8 in the graph: different GEMM shapes). float32: tokens
    identical. bfloat16: every logprob within the tolerance of eager's, a different token
    only where eager's top two were that close; the tolerance is measured, not chosen: eager
    bf16 against itself with 6 of the prompts (``_shape_spread``). Same shapes make 0 the
    expected difference; anything past eager's own shape spread is the graph's doing."""
    from benchmarks.gpu_check_sections import Outcome
    if plan.device != "cuda":
        return Outcome("skipped", "needs CUDA: CUDA graphs exist only on a CUDA device")
    from benchmarks.cuda_graphs import decode_tokens_per_s

    model = str(plan.bench_model())
    prompts = [[1 + (7 * i + j) % 500 for j in range(24 + 5 * i)] for i in range(8)]
    captured, fp32 = {}, {}
    for eager in (True, False):
        captured[eager], fp32[eager] = _greedy(model, eager, "float32", prompts)
    fp32_equal = [o.token_ids for o in fp32[True]] == [o.token_ids for o in fp32[False]]
    bf16 = {eager: _greedy(model, eager, "bfloat16", prompts)[1] for eager in (True, False)}
    tol = _shape_spread(bf16[True], _greedy(model, True, "bfloat16", prompts[:6])[1])
    checks = [_explained(g, e, tol) for g, e in zip(bf16[False], bf16[True])]
    bf16_ok = all(ok for ok, _ in checks)
    worst = max(w for _, w in checks)
    bf16_equal = [o.token_ids for o in bf16[True]] == [o.token_ids for o in bf16[False]]
    speed = {g: decode_tokens_per_s(model, 32, 128, g) for g in (False, True)}
    ok = captured[False] and fp32_equal and bf16_ok
    return Outcome("pass" if ok else "fail",
                   f"graphs captured: {captured[False]}; float32 tokens equal to eager: "
                   f"{fp32_equal}; bfloat16 at equal shapes: tokens equal {bf16_equal}, "
                   f"largest logprob difference {worst:.4f} vs eager's own batch-shape spread "
                   f"{tol:.4f}: {'within' if bf16_ok else 'NOT within'}; decode batch 32: "
                   f"{speed[False]:.0f} tok/s eager, {speed[True]:.0f} with graphs",
                   {"captured": captured[False], "float32_equal": fp32_equal,
                    "bfloat16_tokens_equal": bf16_equal, "bfloat16_within_tol": bf16_ok,
                    "bfloat16_max_logprob_diff": worst, "tolerance": tol,
                    "tolerance_from": "eager bf16, 8 prompts vs 6 of them",
                    "eager_tok_s": speed[False], "graphs_tok_s": speed[True], "model": model})


# -- gpu_busy ----------------------------------------------------------------------------
def _decode_steps(engine: Any, n: int, steps: int, device: str) -> dict[str, float]:
    """Start ``n`` requests, decode until each has its first token, then time ``steps``
    steps plain and ``steps`` under torch.profiler (GPU kernel time / wall time)."""
    from tokenrelay.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    ids = [f"b{n}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [1 + (7 * i + j) % 500 for j in range(64)], params)
    started: set[str] = set()
    while len(started) < n:
        started |= {d.request_id for d in engine.step() if d.new_token_ids}
    for _ in range(3):
        engine.step()
    _sync(device)
    clock = engine.overlap.phases if engine.overlap is not None else None
    if clock is not None:
        clock.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    phases = clock.ms_per_step() if clock is not None else None
    busy = _profiled_busy(engine, steps, device)
    syncs = _sync_warnings(engine, 5, device)
    host = _host_profile(engine, 10)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"ms_per_step": wall_ms, "busy": busy, "host_ms_per_step": phases, "syncs": syncs,
            "host_top": host}


def _host_profile(engine: Any, steps: int, top: int = 12) -> list[tuple[str, float]]:
    """Where the host's time goes, function by function: cProfile over ``steps`` steps, the
    ``top`` functions by their own time, in ms per step (cProfile's overhead included: read
    them against each other). The phase clock says which phase is slow; this says why, so one
    GPU run is enough to know what to cut in the launch and output phases."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats       # {(file, line, name): (cc, nc, tottime, cum, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{Path(f).name}:{line}({name})", round(1000 * v[2] / steps, 3))
            for (f, line, name), v in rows]


def _sync_warnings(engine: Any, steps: int, device: str) -> dict[str, Any] | None:
    """Device syncs torch flags in ``steps`` steps (sync debug mode 'warn'): a ``.item()``,
    a blocking copy, a ``nonzero``. The overlapped step's one intended wait, an event's
    synchronize, is not among them, so there any count above 0 is a sync to remove; a
    serial step reads its ids with ``.tolist()`` on the device tensor: one per step there.
    (Not flagged either: a non-blocking copy from pageable memory, which the driver may
    make synchronous; the step's inputs are pinned for that reason.)"""
    if device != "cuda":
        return None
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [str(w.message).splitlines()[0][:160] for w in caught
             if "synchroniz" in str(w.message).lower()]
    return {"steps": steps, "count": len(found), "first": sorted(set(found))[:3]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profiled_busy(engine: Any, steps: int, device: str) -> float | None:
    """Kernel time on the GPU / wall time over ``steps`` profiled steps (None on CPU)."""
    timed = _kernel_ms(lambda: [engine.step() for _ in range(steps)], device)
    return None if timed is None else timed[0] / timed[1]


def _kernel_ms(run: Any, device: str) -> tuple[float, float] | None:
    """(GPU kernel ms, wall ms) of ``run()`` under torch.profiler (None on CPU): kernel time
    against wall time says whether the kernels or the host set the pace."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000, wall_ms


def gpu_busy(plan: Plan) -> Outcome:
    """How busy the engine keeps the GPU while decoding 128 and 256 sequences of the 1.1B
    model in bfloat16: GPU kernel time / wall time (torch.profiler) and ms per step, with the
    overlapped engine core (the default on CUDA) and, for comparison, serial steps."""
    from benchmarks.gpu_check_sections import Outcome
    from tokenrelay.engine.llm_engine import LLMEngine
    sizes, steps = ((4, 8), 4) if plan.dry else ((128, 256), 30)
    model = str(one_b_model(plan))
    rows: dict[str, dict[str, Any]] = {}
    for overlapped in (True, False):
        engine = LLMEngine.from_kwargs(
            model=model, dtype=_dtype(plan), device=plan.device, max_num_seqs=max(sizes),
            max_model_len=1024, num_kv_blocks=max(sizes) * 12 + 64, max_num_batched_tokens=8192,
            async_scheduling=overlapped, enforce_eager=plan.dry)
        mode = "overlapped" if overlapped else "serial"
        for n in sizes:
            rows[f"{mode} {n}"] = _decode_steps(engine, n, steps, plan.device)
            print(f"   {mode} {n} sequences: {rows[f'{mode} {n}']}", flush=True)
        engine.shutdown()
        del engine
        _free(plan.device)
    busy = [rows[f"overlapped {n}"]["busy"] for n in sizes]
    met = all(b is not None and b >= BUSY_TARGET for b in busy)
    text = "; ".join(_row_text(k, v) for k, v in rows.items())
    note = " (dry run: CPU, no GPU time)" if plan.dry else ""
    return Outcome("pass" if plan.dry or met else "fail",
                   f"{text}; target busy >= {BUSY_TARGET} overlapped: "
                   f"{'met' if met else 'not met'}{note}",
                   {"model": model, "steps": steps, "rows": rows, "target": BUSY_TARGET,
                    "target_met": met})


def _row_text(name: str, row: dict[str, Any]) -> str:
    """One gpu_busy row: ms per step, busy, the host's ms per phase, syncs flagged."""
    text = f"{name}: {row['ms_per_step']:.2f} ms/step"
    if row["busy"] is not None:
        text += f", busy {row['busy']:.2f}"
    if row["host_ms_per_step"]:
        text += " (host ms " + " ".join(f"{k} {v:.2f}" for k, v in
                                        row["host_ms_per_step"].items()) + ")"
    if row["syncs"] is not None:
        text += f", syncs flagged in {row['syncs']['steps']} steps: {row['syncs']['count']}"
    return text


# -- engine_bench_1b ---------------------------------------------------------------------
def _single_stream(model: str, plan: Plan, tokens: int) -> dict[str, float]:
    """ms per output token of one greedy request, ours and transformers', same dtype."""
    from transformers import AutoModelForCausalLM

    from tokenrelay.engine import LLM, SamplingParams
    prompt = [1 + j % 500 for j in range(32)]
    llm = LLM(model, dtype=_dtype(plan), device=plan.device, max_model_len=1024,
              num_kv_blocks=256, max_num_seqs=8, enforce_eager=plan.dry)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)                                   # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    ours = (time.perf_counter() - t0) * 1000 / tokens
    gpu = _kernel_ms(lambda: llm.generate([prompt], params), plan.device)
    llm.shutdown()
    del llm
    _free(plan.device)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, _dtype(plan)))
    hf = hf.to(plan.device).eval()
    ids = torch.tensor([prompt], device=plan.device)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync(plan.device)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                    eos_token_id=None, pad_token_id=0)
        _sync(plan.device)
    theirs = (time.perf_counter() - t0) * 1000 / tokens
    del hf
    _free(plan.device)
    return {"engine_ms_per_token": ours, "transformers_ms_per_token": theirs,
            "engine_gpu_ms_per_token": None if gpu is None else gpu[0] / tokens}


def _gpu_text(stream: dict[str, Any]) -> str:
    gpu = stream["engine_gpu_ms_per_token"]
    return "no GPU time on CPU" if gpu is None else f"GPU kernels {gpu:.2f} ms/token"


def engine_bench_1b(plan: Plan) -> Outcome:
    """Our engine against transformers' static (batches of 64) and continuous batching on
    the 1.1B model, every side in bfloat16: 256 mixed requests (prompts 16-384, outputs
    16-192, greedy, ignore_eos), and one stream's ms per token. A dry run: the tiny model,
    6 short requests, static batching only."""
    from benchmarks.gpu_check_sections import Outcome
    from benchmarks import engine as bench
    from tokenrelay.engine.model_config import ModelConfig

    model = str(one_b_model(plan))
    n, prompts, outputs = (6, (8, 24), (4, 8)) if plan.dry else (256, (16, 384), (16, 192))
    args = argparse.Namespace(dtype=_dtype(plan), device=plan.device, max_model_len=1024,
                              num_kv_blocks=256 if plan.dry else 8192,
                              max_num_batched_tokens=8192, hf_batch_size=64)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    work = bench.make_workload(n, prompts, outputs, vocab, seed=0)
    ours = bench.bench_engine(model, work, args)
    _free(plan.device)
    rows: dict[str, Any] = {"engine": ours["tok_s"]}
    rows["transformers static"] = bench.bench_hf_static(model, work, args)["tok_s"]
    _free(plan.device)
    if not plan.dry:
        try:
            rows["transformers continuous"] = bench.bench_hf_continuous(model, work, args)["tok_s"]
        except Exception as exc:            # transformers' own mode failing is not ours
            rows["transformers continuous error"] = f"{type(exc).__name__}: {exc}"
        _free(plan.device)
    stream = _single_stream(model, plan, 8 if plan.dry else 64)
    best = max(v for k, v in rows.items() if k != "engine" and isinstance(v, float))
    x = ours["tok_s"] / best
    met = (x >= SPEED_TARGET_X and ours["tok_s"] >= SPEED_TARGET_TOK_S
           and stream["engine_ms_per_token"] <= STREAM_TARGET_MS)
    note = " (dry run: CPU, not a measurement)" if plan.dry else ""
    return Outcome(
        "pass" if plan.dry or met else "fail",
        f"{n} requests, {_dtype(plan)}: engine {ours['tok_s']:.0f} output tok/s, best "
        f"transformers mode {best:.0f} ({x:.1f}x); one stream {stream['engine_ms_per_token']:.2f}"
        f" ms/token ({_gpu_text(stream)}) vs transformers "
        f"{stream['transformers_ms_per_token']:.2f}; targets >= "
        f"{SPEED_TARGET_X:g}x, >= {SPEED_TARGET_TOK_S:.0f} tok/s, <= {STREAM_TARGET_MS:g} "
        f"ms/token: {'met' if met else 'not met'}{note}",
        {"model": model, "requests": n, "dtype": _dtype(plan), "tok_s": rows, "x_best": x,
         "single_stream": stream, "target_met": met,
         "kv_utilization_peak": ours["stats"].get("kv_utilization_peak")})
