"""Kernel benchmark: correctness against the references, then speed.

    python -m benchmarks.kernels                       # CUDA: bf16 checks + timings at Llama-3-8B sizes
    python -m benchmarks.kernels --check-only --small  # anywhere (CPU: Triton interpreter), tiny sizes

Timings are benchmarks.kernel_roofline's (the GPU check's kernel_roofline section): each
kernel against its roofline, with issue #38's targets. Kernels only: the engine's decode
tokens/s with CUDA graphs off and on is `python -m benchmarks.engine --cuda-graphs` (`kernels` imports nothing of the engine).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch


@dataclass
class CheckResult:
    kernel: str
    label: str
    max_err: float
    ok: bool


def _on_cpu_without_interpreter() -> bool:
    return not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _clone_args(case, positions: tuple[int, ...]) -> tuple:
    return tuple(a.clone() if i in positions else a for i, a in enumerate(case.args))


def _compared(case, args: tuple, result) -> list[torch.Tensor]:
    return [args[i] for i in case.mutated] + ([result] if result is not None else [])


def check_case(case) -> CheckResult:
    """Run kernel and reference on equal inputs (in-place targets cloned) and compare."""
    from tokenrelay.kernels._testing import tolerance

    kernel, ref = case.fns()
    k_args, r_args = _clone_args(case, case.mutated), _clone_args(case, case.mutated)
    got = _compared(case, k_args, kernel(*k_args))
    want = _compared(case, r_args, ref(*r_args))
    tol = tolerance(case.args[0].dtype)
    worst, ok = 0.0, True
    for g, w in zip(got, want):
        err, close = _compare(g, w, tol["rtol"], tol["atol"])
        worst, ok = max(worst, err), ok and close
    return CheckResult(case.kernel, case.label, worst, ok)


def _compare(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    """(max abs error, all within atol + rtol*|want|), in chunks: the KV pools are many GB and an
    fp32 copy of the whole difference would not fit beside them. NaN counts as not close."""
    if torch.equal(got, want):
        return 0.0, True
    worst, ok = 0.0, True
    for g, w in zip(got.reshape(-1).split(1 << 26), want.reshape(-1).split(1 << 26)):
        diff = (g.float() - w.float()).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool(torch.all(diff <= atol + rtol * w.float().abs()))
    return worst, ok


def run_checks(small: bool = True, dtype: torch.dtype = torch.bfloat16, device: str | None = None,
               seed: int = 0) -> list[CheckResult]:
    """Every kernel vs its reference; the part of the bench the CPU test-suite runs (small=True)."""
    from benchmarks.kernel_cases import all_cases

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    return [check_case(c) for c in all_cases(small, dtype, device)]


def _print_checks(results: list[CheckResult]) -> None:
    print(f"{'kernel':26} {'case':34} {'max err':>10}  ok")
    for r in results:
        print(f"{r.kernel:26} {r.label[:34]:34} {r.max_err:10.2e}  {'yes' if r.ok else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-only", action="store_true", help="correctness only, no timings")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter friendly)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    if _on_cpu_without_interpreter():
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels (any @triton.jit module) is imported
    cuda = torch.cuda.is_available()
    if not cuda and not (args.check_only and args.small):
        print("no CUDA device: only `--check-only --small` runs here (Triton interpreter)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    results = run_checks(small=args.small, dtype=dtype)
    _print_checks(results)
    ok = all(r.ok for r in results)
    if args.check_only:
        return 0 if ok else 1
    from benchmarks.kernel_roofline import run

    print("\n" + "\n".join(run(args.small, "cuda", dtype)["lines"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
