"""Compile every kernel with the real Triton compiler for an NVIDIA target, no GPU needed.

    python -m tokenrelay.kernels.compile_check [--arch 90] [--dtype bf16]

Why: the interpreter runs Python, not the compiler, so it accepts things the GPU build rejects
(tl.dot with K < 16 on 16-bit inputs, type mismatches in loops, unsupported constexpr use). This
lowers each kernel, at the bench's Llama-3-8B configuration, through TTIR -> TTGIR -> LLVM -> PTX
-> cubin (Triton ships ptxas), so a kernel that would not build on the GPU fails here first.
Must run *without* TRITON_INTERPRET (it unsets it before importing the kernels).

    python -m tokenrelay.kernels.compile_check --launcher

The other half of a first kernel launch: Triton builds its CUDA driver module and each kernel's
launcher as a Python C extension with the system's C compiler (``CC``, else gcc, else clang)
and Python's headers. An image without them (a CUDA *runtime* base) fails at the first step of
the first request; this compiles Triton's own ``driver.c`` the same way (to an object file: no
``libcuda`` needed), so the worker image's build fails instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time


def _specs(dt: str) -> list[tuple[str, str, dict, dict]]:
    """(module, kernel, runtime-arg types, constexprs) for each kernel at the bench config."""
    p, i32, i64, f32 = f"*{dt}", "i32", "i64", "fp32"
    cache = dict(cache_stride_blk=i64, cache_stride_tok=i32, cache_stride_head=i32)
    attn = dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_D=128, BLOCK_N=64,
                PRECISION="ieee" if dt == "fp32" else "tf32")
    return [
        ("tokenrelay.kernels.store_kv", "_store_kv_kernel",
         dict(key_ptr=p, value_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_ptr="*i64",
              num_tokens=i32, key_stride=i32, value_stride=i32),
         dict(ROW=1024, BLOCK_T=8, BLOCK_ROW=1024)),
        *[("tokenrelay.kernels.decode_attention", "_decode_split_kernel",
           dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                out_ptr=p, part_out_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32",
                qk_scale=f32, max_splits=i32, q_stride_b=i32, q_stride_h=i32, bt_stride=i32,
                **cache),
           dict(attn, BLOCK_G=16, SPLIT_TILES=4, DIRECT=direct, NATIVE=dt != "fp32",
                PREFETCH_ROWS=True, FUSED=fused))
          for direct, fused in ((True, False), (False, False), (False, True))],
        ("tokenrelay.kernels.decode_attention", "_decode_merge_kernel",
         dict(out_ptr=p, part_out_ptr="*fp32", part_lse_ptr="*fp32", seq_lens_ptr="*i32",
              max_splits=i32),
         dict(GROUP=4, HEAD_DIM=128, BLOCK_G=4, BLOCK_D=128, SPLIT_TOKENS=256)),
        ("tokenrelay.kernels.prefill_attention", "_prefill_kernel",
         dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32", seq_lens_ptr="*i32",
              cu_ptr="*i32", out_ptr=p, qk_scale=f32, num_seqs=i32, q_stride_t=i32,
              q_stride_h=i32, bt_stride=i32, **cache),
         dict(attn, BLOCK_GP=4, BLOCK_Q=16, BLOCK_M=128, NATIVE=dt != "fp32",
              PREFETCH_ROWS=True)),
        ("tokenrelay.kernels.norm", "_rms_norm_kernel",
         dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, num_rows=i32, x_stride=i32, res_stride=i32,
              out_stride=i32, eps=f32),
         dict(HIDDEN=4096, BLOCK_T=1, BLOCK_H=4096, ADD_RESIDUAL=True)),
        ("tokenrelay.kernels.rotary", "_rotary_kernel",
         dict(q_ptr=p, k_ptr=p, pos_ptr="*i64", cache_ptr="*fp32", num_tokens=i32, q_stride_t=i32,
              q_stride_h=i32, k_stride_t=i32, k_stride_h=i32, cache_stride=i32),
         dict(NUM_Q=32, NUM_K=8, HALF=64, BLOCK_T=2, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, IS_NEOX=True)),
        ("tokenrelay.kernels.activation", "_silu_and_mul_kernel",
         dict(x_ptr=p, out_ptr=p, num_rows=i32, x_stride=i32, out_stride=i32),
         dict(INTER=14336, BLOCK_T=4, BLOCK_I=1024)),
    ]


def compile_all(arch: int = 90, dtype: str = "bf16") -> list[tuple[str, float, dict]]:
    """Compile each kernel to a cubin, with its module's NUM_WARPS / NUM_STAGES where it has
    them (else 4 / 2); returns (name, seconds, PTX instruction counts: 16-byte
    vector loads, async copies (software pipelining), tensor-core mma) and shared memory. Raises
    on failure."""
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    done = []
    for module, name, runtime, constexprs in _specs(dtype):
        mod = importlib.import_module(module)
        fn = getattr(mod, name)
        if not hasattr(fn, "arg_names"):
            raise RuntimeError(f"{module}.{name} is interpreted: run without TRITON_INTERPRET=1")
        missing = set(fn.arg_names) - set(runtime) - set(constexprs)
        if missing:
            raise RuntimeError(f"{name}: no type given for {sorted(missing)}")
        signature = {a: runtime.get(a, "constexpr") for a in fn.arg_names}
        # What the JIT would know at a real launch: torch allocations are 16-byte aligned and the
        # strides of these shapes are multiples of 16 (it specializes on both).
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if runtime.get(a, "").startswith("*") or "stride" in a}
        t0 = time.perf_counter()
        compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=getattr(mod, "NUM_WARPS", 4),
                                               num_stages=getattr(mod, "NUM_STAGES", 2)))
        label = name if "DIRECT" not in constexprs else (
            f"{name}[DIRECT={constexprs['DIRECT']}, FUSED={constexprs['FUSED']}]")
        ptx = compiled.asm["ptx"]
        notes = {k: ptx.count(k) for k in ("ld.global.v4", "cp.async.cg", "mma.sync", "wgmma.mma_async")}
        notes["shared KB"] = compiled.metadata.shared // 1024   # what caps programs per SM
        done.append((label, time.perf_counter() - t0, notes))
    return done


def compile_launcher() -> str:
    """Compile Triton's CUDA driver source as Triton would at the first launch (minus linking
    ``libcuda``, which only a GPU host has). Returns the compiler used; raises RuntimeError
    naming what is missing."""
    import triton.backends.nvidia as nvidia

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or clang, or CC=...): Triton compiles its "
                           "launchers with one at the first kernel launch; install gcc")
    source = os.path.join(os.path.dirname(nvidia.__file__), "driver.c")
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)[
        "include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        raise RuntimeError(f"no Python.h in {include}: Triton's launchers are Python C "
                           f"extensions; install the Python headers (python3-dev)")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [cc, source, "-c", "-O3", "-fPIC", "-o", os.path.join(tmp, "driver.o"),
               f"-I{os.path.join(os.path.dirname(source), 'include')}", f"-I{include}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"cannot run the C compiler {cc}: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-800:]}")
    return cc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--launcher", action="store_true",
                    help="only check the C toolchain Triton builds its launchers with")
    args = ap.parse_args(argv)
    if args.launcher:
        try:
            print(f"Triton's CUDA driver source compiles with {compile_launcher()}")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    for name, secs, notes in compile_all(args.arch, args.dtype):
        counts = "  ".join(f"{v} KB shared" if k == "shared KB" else f"{k} x{v}"
                           for k, v in notes.items())
        print(f"sm_{args.arch} {args.dtype}: {name:38} {secs:5.1f} s   {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
