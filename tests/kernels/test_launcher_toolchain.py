"""``python -m tokenrelay.kernels.compile_check --launcher``: the worker image's build runs it, so an image
in which Triton could not build its launchers (no C compiler, no Python headers) fails to build
instead of failing at its first request on a GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT


def run(env_cc: str | None) -> subprocess.CompletedProcess:
    import os
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    if env_cc is not None:
        env["CC"] = env_cc
    return subprocess.run([sys.executable, "-m", "tokenrelay.kernels.compile_check", "--launcher"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None,
                    reason="no C compiler on this host")
def test_triton_driver_source_compiles_with_the_system_compiler():
    out = run(None)
    assert out.returncode == 0, out.stderr
    assert "compiles with" in out.stdout


def test_a_missing_compiler_is_one_line_and_exit_1():
    out = run("/nonexistent/cc")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "cannot run the C compiler /nonexistent/cc" in out.stderr
