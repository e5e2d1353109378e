"""Every Triton kernel against its roofline, one row per kernel and case (issue #38).

The memory-bound kernels (store_kv, decode attention, the pointwise ops) as GB/s of the minimum
bytes one call must move, against a device-to-device copy (read + write): the practical roofline.
Two times per case: eager (triton's do_bench: the launcher's Python and Triton's launch included
where they outlast the GPU work) and replayed from a CUDA graph, as the engine runs decode steps
(the GPU's time alone). Before each replay L2 is flushed by *reading* 256 MB: do_bench's flush
writes them, and the ~50 MB of dirty lines it leaves are written back during the timed kernel
(the 16:01 H200 run suggests it: a ~6 us floor under every small kernel, store_kv's 16 MB too).
Targets are judged on the graph time; the eager column shows what launch overhead adds.
Paged prefill attention as TFLOP/s against torch's scaled_dot_product_attention (flash backend on
CUDA) on the same shapes in the same run. Cases and sizes are benchmarks/kernel_cases.py's
(Llama-3-8B shapes). Each kernel also runs once under CUDA's sync debug mode: a launcher that
synchronizes the device shows in the ``syncs`` column. Decode and prefill attention and store_kv
are swept over their constants (configs below) so the next GPU run says which to keep.

On CPU (the GPU check's dry run) everything runs interpreted at tiny sizes: not a measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

DECODE_MIN_BATCH, DECODE_TARGET = 8, 0.85          # of copy bandwidth, 4k context
DECODE_BATCH1_MS = 0.020
POINTWISE_TARGET = 0.70                            # store_kv and the pointwise ops, of copy
PREFILL_TARGET = 0.8                               # of SDPA's TFLOP/s
# Decode configs: (name, decode_attention constants, paged_tile constants, split tokens). The
# 16:18 H200 run: split 512 vs 256 and 2 vs 4 programs per SM changed little; per-page table reads
# were 2-4x slower (dropped). "1618" is the kernel it measured; the rest vary one knob or two
# from the default (native dots, table prefetch, 64 tokens, 4 warps, 3 stages, 4 per SM).
# Shared memory on sm_90 (bf16, this build): n64 s3 78 KB (2 programs an SM), n64 s4 110 KB,
# n32 s3 45 KB (5 an SM), n32 s4 61 KB (3 an SM), n128 s3 143 KB (1 an SM).
# "fused merge" rows merge the splits in the split kernel (FUSED_MERGE: one launch, the last
# program of each (sequence, KV head) merges), each beside its two-kernel twin; the module's
# default is "default, split 512, 2 per SM". They also check, on the GPU, that the fused path
# gives the two-kernel path's bits, leaves its counters at 0 after the replays, and never syncs.
_D1618 = dict(BLOCK_N=64, NUM_WARPS=4, NUM_STAGES=2, PREFETCH_ROWS=False, PROGRAMS_PER_SM=4,
              FUSED_MERGE=False)
_DDEF = dict(_D1618, NUM_STAGES=3, PREFETCH_ROWS=True)
_DFUSED = dict(_DDEF, PROGRAMS_PER_SM=2, FUSED_MERGE=True)
SWEEP = (
    ("1618: tf32, no prefetch, n64 w4 s2", _D1618, False, 256),
    ("native, no prefetch, n64 w4 s2", _D1618, True, 256),
    ("native, prefetch, n64 w4 s2", dict(_DDEF, NUM_STAGES=2), True, 256),
    ("default: native, prefetch, n64 w4 s3", _DDEF, True, 256),
    ("default, 2 per SM", dict(_DDEF, PROGRAMS_PER_SM=2), True, 256),
    ("fused merge, 2 per SM", _DFUSED, True, 256),
    ("default, s4, 2 per SM", dict(_DDEF, NUM_STAGES=4, PROGRAMS_PER_SM=2), True, 256),
    ("default, w8", dict(_DDEF, NUM_WARPS=8), True, 256),
    ("default, n32", dict(_DDEF, BLOCK_N=32), True, 256),
    ("default, n32 s4", dict(_DDEF, BLOCK_N=32, NUM_STAGES=4), True, 256),
    ("default, n32 s4, 3 per SM", dict(_DDEF, BLOCK_N=32, NUM_STAGES=4, PROGRAMS_PER_SM=3),
     True, 256),
    ("default, n128 s2", dict(_DDEF, BLOCK_N=128, NUM_STAGES=2), True, 256),
    ("default, n128 s3 w8, 2 per SM", dict(_DDEF, BLOCK_N=128, NUM_WARPS=8, PROGRAMS_PER_SM=2),
     True, 256),
    ("default, split 512", _DDEF, True, 512),
    ("default, split 512, 2 per SM", dict(_DDEF, PROGRAMS_PER_SM=2), True, 512),
    ("fused merge, split 512, 2 per SM", _DFUSED, True, 512),
    ("default, split 128", _DDEF, True, 128),
    ("default, split 128, 2 per SM", dict(_DDEF, PROGRAMS_PER_SM=2), True, 128),
    ("fused merge, split 128, 2 per SM", _DFUSED, True, 128),
)
DRY_SWEEP = tuple((name, consts, native, 64) for name, consts, native, _ in
                  (SWEEP[0], SWEEP[3], next(c for c in SWEEP if c[1]["FUSED_MERGE"])))
# Prefill configs: (name, prefill_attention constants, native dots). 16:18: 128 rows x 8 warps
# 41.3 TFLOP/s with tf32 dots, 64 x 4 39.4.
_P1618 = dict(TILE_ROWS=128, NUM_WARPS=8, BLOCK_N=64, NUM_STAGES=2, PREFETCH_ROWS=False)
_PDEF = dict(_P1618, NUM_STAGES=3, PREFETCH_ROWS=True)
PREFILL_SWEEP = (
    ("1618: tf32, m128 w8 n64 s2", _P1618, False),
    ("native, m128 w8 n64 s2", _P1618, True),
    ("default: native, prefetch, m128 w8 n64 s3", _PDEF, True),
    ("default, s4", dict(_PDEF, NUM_STAGES=4), True),
    ("default, w4", dict(_PDEF, NUM_WARPS=4), True),
    ("default, n128 s2", dict(_PDEF, BLOCK_N=128, NUM_STAGES=2), True),
    ("default, n128 s3", dict(_PDEF, BLOCK_N=128), True),
    ("default, m64 w4", dict(_PDEF, TILE_ROWS=64, NUM_WARPS=4), True),
)
# Memory-bound kernels: module -> (the cases it serves, (elements per program, warps) to try;
# the default first). At 16:18 store_kv did not move with elements (2048-8192) at 4 warps.
POINTWISE_SWEEP = {
    "store_kv": (("store_kv",), ((8192, 4), (8192, 8), (16384, 8), (16384, 16), (2048, 1))),
    "norm": (("rms_norm", "fused_add_rms_norm"), ((4096, 4), (4096, 8), (4096, 16), (8192, 8),
                                                   (16384, 16))),
    "rotary": (("rotary",), ((4096, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16))),
}


@dataclass
class Row:
    kernel: str
    case: str
    eager_ms: float           # do_bench: launch overhead included where it dominates
    ms: float                 # replayed from a CUDA graph (eager on CPU): what targets judge
    value: float              # GB/s, or TFLOP/s for prefill, at ``ms``
    unit: str
    of_roofline: float        # value / copy GB/s, or / SDPA's TFLOP/s for prefill
    target: str
    met: Optional[bool]       # None: no target for this case
    syncs: str
    of_same_copy: Optional[float] = None   # a copy of the same bytes, replayed the same way: ms / ms

    def line(self) -> str:
        verdict = {None: "", True: "met", False: "NOT met"}[self.met]
        same = "" if self.of_same_copy is None else f"  same-size copy {100 * self.of_same_copy:4.0f}%"
        return (f"{self.kernel:24} {self.case[:30]:30} {self.eager_ms * 1000:9.1f} us eager "
                f"{self.ms * 1000:9.1f} us graph "
                f"{self.value:8.1f} {self.unit:7} {100 * self.of_roofline:5.0f}%  "
                f"{self.target:22} {verdict:8} syncs: {self.syncs}{same}")


def timer(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA, a wall-clock loop on CPU."""
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[1]


def graph_timer(fn: Callable[[], Any], device: str, reps: int = 50) -> float:
    """Median milliseconds of one CUDA-graph replay of ``fn`` (L2 flushed before each by a read
    of 256 MB, which leaves no dirty line to write back, outside the timed span); ``timer`` on
    CPU. Captured on the stream it warmed up on: state a launcher keeps per stream (decode's
    fused-merge counters) then exists before capture, so no allocation lands in the graph."""
    if device != "cuda":
        return timer(fn, device)
    flush = torch.zeros(64 << 20, dtype=torch.int32, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                         # warm: compiled, allocator primed
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    times = []
    for _ in range(reps):
        flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2]


def copy_gbs(device: str, nbytes: int) -> float:
    """Device-to-device copy bandwidth, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src), device) / 1e6


def same_size_copy_ms(nbytes: int, device: str) -> float:
    """Graph-replay ms of a copy moving ``nbytes`` (read + write), timed as the kernels are:
    what a memory-bound kernel of that size can reach once a replay's fixed cost (launch, L2
    ramp, ~4-5 us under every small kernel at 16:18) is counted. Shown beside the target (which
    stays judged against the large copy)."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return graph_timer(lambda: dst.copy_(src), device)


def syncs_of(fn: Callable[[], Any], device: str) -> str:
    """'none' when ``fn`` runs under CUDA's sync debug mode without a synchronizing call, else
    the error; 'n/a' on CPU (tests/kernels/test_no_sync.py proves it there)."""
    if device != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as exc:
        return f"SYNC ({str(exc).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def target_of(kernel: str, case: str, ms: float, of_roofline: float) -> tuple[str, Optional[bool]]:
    """(the target's text, met or not, None where the case has none)."""
    if kernel == "paged_decode_attention":
        batch = int(case.split()[1])
        if batch == 1:
            return f"<= {DECODE_BATCH1_MS * 1000:.0f} us", ms <= DECODE_BATCH1_MS
        if batch >= DECODE_MIN_BATCH:
            return f">= {DECODE_TARGET:.0%} of copy", of_roofline >= DECODE_TARGET
        return "none", None
    if kernel == "paged_prefill_attention":
        return f">= {PREFILL_TARGET}x SDPA", of_roofline >= PREFILL_TARGET
    return f">= {POINTWISE_TARGET:.0%} of copy", of_roofline >= POINTWISE_TARGET


def _dense_prefill(case, device: str) -> list[tuple[torch.Tensor, ...]]:
    """The prefill case as SDPA inputs, one (q, k, v) per sequence: [1, Hq, len, D], K/V
    gathered from the pool and repeated per query head (outside the timed call)."""
    query, k_cache, v_cache, table, seq_lens, cu = case.args[:6]
    page, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = []
    for b, (lo, hi) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=device)
        slots = table[b].long()[pos // page] * page + pos % page
        k, v = (c.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)[None]
                for c in (k_cache, v_cache))
        out.append((query[lo:hi].transpose(0, 1)[None], k.contiguous(), v.contiguous()))
    return out


def sdpa_prefill(case, device: str) -> tuple[float, str]:
    """(ms, backend) of SDPA over the prefill case's sequences, each causal to the lower right
    (a query sees its prefix), replayed from a CUDA graph as the kernel is: flash on CUDA where
    torch takes it, else torch's default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    seqs = _dense_prefill(case, device)
    masks = [causal_lower_right(q.shape[2], k.shape[2]) for q, k, _ in seqs]
    scale = case.args[6]

    def run() -> None:
        for (q, k, v), mask in zip(seqs, masks):
            sdpa(q, k, v, attn_mask=mask, scale=scale)

    if device == "cuda":
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return graph_timer(run, device), "flash"
        except RuntimeError as exc:
            return graph_timer(run, device), f"default (flash refused: {str(exc)[:60]})"
    return graph_timer(run, device), "default"


def measure(cases: list, device: str, copy: float) -> tuple[list[Row], dict[str, str]]:
    """One row per case; and notes (the SDPA backend that ran)."""
    rows, notes = [], {}
    for case in cases:
        kernel, _ = case.fns()
        eager_ms = timer(lambda: kernel(*case.args, **case.kwargs), device)
        ms = graph_timer(lambda: kernel(*case.args, **case.kwargs), device)
        syncs = syncs_of(lambda: kernel(*case.args, **case.kwargs), device)
        same = None
        if case.kernel == "paged_prefill_attention":
            ref_ms, notes["sdpa_backend"] = sdpa_prefill(case, device)
            value, unit, frac = case.flops / ms / 1e9, "TFLOP/s", ref_ms / ms
            notes["sdpa_tflops"] = f"{case.flops / ref_ms / 1e9:.1f}"
        else:
            value, unit = case.nbytes / ms / 1e6, "GB/s"
            frac = value / copy
            same = same_size_copy_ms(case.nbytes, device) / ms
        target, met = target_of(case.kernel, case.label, ms, frac)
        rows.append(Row(case.kernel, case.label, eager_ms, ms, value, unit, frac, target, met,
                        syncs, same))
    return rows, notes


@contextmanager
def _constants(module: Any, **values: Any) -> Iterator[None]:
    """A kernel module's tuning constants set to ``values`` for a sweep, restored after."""
    kept = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(module, name, value)


def _timed(fn: Callable[[], Any], device: str) -> tuple[float, str]:
    """(graph-replay ms, '') or (nan, why) when the config does not build or launch (a sweep
    row may ask for more shared memory than an SM has): one bad row never costs the others."""
    try:
        return graph_timer(fn, device), ""
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return float("nan"), f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def fused_checks(case, split: int, device: str) -> dict[str, Any]:
    """For a fused-merge row, under its constants: whether its output has the two-kernel path's
    bits (same constants otherwise), whether every ticket counter is back at 0 after the row's
    eager calls and graph replays, and the syncs (CUDA's sync debug mode)."""
    from tokenrelay.kernels import decode_attention as decode

    def call() -> torch.Tensor:
        return decode.paged_decode_attention(*case.args, split_tokens=split)

    try:
        syncs = syncs_of(call, device)
        fused = call()
        with _constants(decode, FUSED_MERGE=False):
            two = call()
        counters = [*decode._COUNTERS.values(), *decode._RETIRED]
        return {"same_bits": bool(torch.equal(fused, two)),
                "counters_zero": all(not bool(c.any()) for c in counters), "syncs": syncs}
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"same_bits": False, "counters_zero": False,
                "syncs": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"}


def decode_sweep(cases: list, device: str, copy: float, configs: tuple) -> list[dict]:
    """Decode attention at each config (tile, warps, stages, table prefetch, dots, programs per
    SM, split size, fused merge): which constants to keep. Fused-merge rows add fused_checks."""
    from tokenrelay.kernels import decode_attention as decode, paged_tile

    out = []
    for name, consts, native, split in configs:
        with _constants(decode, **consts), _constants(paged_tile, NATIVE_DOTS=native):
            for case in cases:
                ms, error = _timed(lambda: decode.paged_decode_attention(
                    *case.args, split_tokens=split), device)
                row = {"config": name, "case": case.label, "us": ms * 1000,
                       "of_copy": case.nbytes / ms / 1e6 / copy, "error": error}
                if consts.get("FUSED_MERGE"):
                    row.update(fused_checks(case, split, device))
                out.append(row)
    return out


def _fused_note(row: dict) -> str:
    if "same_bits" not in row:
        return ""
    yes = {True: "yes", False: "NO"}
    return (f" bits = two-kernel: {yes[row['same_bits']]}; counters 0: "
            f"{yes[row['counters_zero']]}; syncs: {row['syncs']}")


def prefill_sweep(case, device: str, configs: tuple) -> list[dict]:
    """Prefill attention at each config (tile rows, warps, keys per tile, stages, prefetch,
    dots): TFLOP/s, which to keep."""
    from tokenrelay.kernels import paged_tile, prefill_attention as prefill

    out = []
    for name, consts, native in configs:
        with _constants(prefill, **consts), _constants(paged_tile, NATIVE_DOTS=native):
            ms, error = _timed(lambda: prefill.paged_prefill_attention(*case.args), device)
        out.append({"config": name, "us": ms * 1000, "tflops": case.flops / ms / 1e9,
                    "error": error})
    return out


def pointwise_sweep(cases: list, device: str, copy: float, grid: dict) -> list[dict]:
    """store_kv, the norms and rotary at each (elements per program, warps): % of copy, which
    constants to keep."""
    import importlib

    out = []
    for module_name, (kernels, configs) in grid.items():
        module = importlib.import_module(f"tokenrelay.kernels.{module_name}")
        for elems, warps in configs:
            with _constants(module, ELEMS_PER_PROGRAM=elems, NUM_WARPS=warps):
                for case in (c for c in cases if c.kernel in kernels):
                    kernel, _ = case.fns()
                    ms, error = _timed(lambda: kernel(*case.args, **case.kwargs), device)
                    out.append({"kernel": case.kernel, "elems_per_program": elems,
                                "warps": warps, "us": ms * 1000,
                                "of_copy": case.nbytes / ms / 1e6 / copy, "error": error})
    return out


def run(dry: bool, device: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Every case's row, the decode sweep and the copy bandwidth, as a JSON-able dict."""
    from benchmarks.kernel_cases import all_cases

    torch.manual_seed(1)
    copy = copy_gbs(device, (1 << 20) if dry else (1 << 30))
    cases = all_cases(dry, dtype, device)
    rows, notes = measure(cases, device, copy)
    decode_cases = [c for c in cases if c.kernel == "paged_decode_attention"]
    sweep = decode_sweep(decode_cases, device, copy, DRY_SWEEP if dry else SWEEP)
    prefill = prefill_sweep(next(c for c in cases if c.kernel == "paged_prefill_attention"),
                            device, PREFILL_SWEEP[1:3] if dry else PREFILL_SWEEP)
    stores = pointwise_sweep(cases, device, copy, {m: (k, (c[0], c[-1]) if dry else c)
                                                   for m, (k, c) in POINTWISE_SWEEP.items()})
    return {"copy_gbs": copy, "rows": [asdict(r) for r in rows], "notes": notes,
            "sweep": sweep, "prefill_sweep": prefill, "pointwise_sweep": stores,
            "lines": report_lines(rows, copy, notes, sweep, prefill, stores)}


def report_lines(rows: list[Row], copy: float, notes: dict[str, str],
                 sweep: list[dict], prefill: list[dict], stores: list[dict]) -> list[str]:
    lines = [f"device-to-device copy {copy:.1f} GB/s; prefill against SDPA "
             f"({notes.get('sdpa_backend', '-')}, {notes.get('sdpa_tflops', '-')} TFLOP/s)"]
    lines += [r.line() for r in rows]
    lines.append("decode sweep (config; the 16:18 kernel first): us, % of copy")
    lines += [f"  {x['config'][:40]:40} {x['case'][:18]:18} {x['us']:8.1f} us "
              f"{100 * x['of_copy']:4.0f}% {x['error']}{_fused_note(x)}" for x in sweep]
    lines.append("prefill sweep (config; the 16:18 kernel first): us, TFLOP/s")
    lines += [f"  {p['config'][:44]:44} {p['us']:8.1f} us {p['tflops']:6.1f} TFLOP/s "
              f"{p['error']}" for p in prefill]
    lines.append("memory-bound sweep (elements per program, warps; the default first): us, % of copy")
    lines += [f"  {x['kernel']:20} {x['elems_per_program']:6} elems {x['warps']:2} warps "
              f"{x['us']:8.1f} us {100 * x['of_copy']:4.0f}% {x['error']}" for x in stores]
    return lines
