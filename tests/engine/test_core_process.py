"""The engine core in a process of its own (engine/core_client.py, engine/core_process.py).

What it promises: the same tokens, text, finish reasons and logprobs as the in-process
engine (seeds, stop strings the output processor finds across the boundary, n > 1, beams,
grammars, aborts, resumes); and no process outlives what it serves: a core SIGKILLed or
stopped fails its front end (``on_failure`` once, every later call raises), a front end
SIGKILLed takes its core with it within a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tokenrelay.engine import SamplingParams, StructuredOutputsParams
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.core_client import EngineCoreClient, EngineCoreError
from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.outputs import RequestDelta, ResumeState, merge_deltas

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_thread")]


def config(path: Path, **kw: Any) -> EngineConfig:
    base = dict(model=str(path), device="cpu", dtype="float32", max_num_seqs=8,
                max_model_len=256, num_kv_blocks=96, enforce_eager=True)
    return EngineConfig(**{**base, **kw})


def drive(engine: Any, requests: list[tuple], abort_after: dict[str, int] | None = None,
          ) -> dict[tuple[str, int], RequestDelta]:
    """Run requests to the end; each choice's deltas merged into one. ``abort_after``:
    request id -> abort once it has streamed this many tokens."""
    for rid, prompt, params, resume in requests:
        engine.add_request(rid, prompt, params, resume=resume)
    got: dict[tuple[str, int], list[RequestDelta]] = {}
    counts: dict[str, int] = {}
    abort_after = dict(abort_after or {})
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine never finished"
        for d in engine.step():
            assert d.error is None, d.error
            got.setdefault((d.request_id, d.index), []).append(d)
            counts[d.request_id] = counts.get(d.request_id, 0) + len(d.new_token_ids)
        for rid, n in list(abort_after.items()):
            if counts.get(rid, 0) >= n:
                assert engine.abort_request(rid)
                del abort_after[rid]
    return {k: merge_deltas(v)[0] for k, v in got.items()}


def workload() -> list[tuple]:
    """Every path the output processor and the core share: seeds, stop strings (several
    steps' tokens held back, then cut), n > 1, logprobs, beams, a grammar, a resume."""
    reqs: list[tuple] = []
    for i in range(6):
        reqs.append((f"s{i}", f"sampled request number {i} says", SamplingParams(
            max_tokens=24, temperature=0.9, seed=100 + i, n=1 + i % 3,
            stop=["e", " th"] if i % 2 == 0 else None, logprobs=2 if i == 1 else None), None))
    reqs.append(("greedy", "a greedy one", SamplingParams(max_tokens=16, temperature=0.0,
                                                           ignore_eos=True), None))
    reqs.append(("beam", "beams of", SamplingParams(beam_width=3, max_tokens=6,
                                                    temperature=0.0), None))
    reqs.append(("json", "pick one", SamplingParams(
        max_tokens=8, temperature=0.7, seed=5,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"])), None))
    reqs.append(("resumed", "resume me", SamplingParams(max_tokens=12, temperature=0.0,
                                                        ignore_eos=True),
                 ResumeState(output_token_ids=[40, 41, 42], output_text="xyz")))
    return reqs


def comparable(out: dict[tuple[str, int], RequestDelta]) -> dict:
    return {k: (d.new_token_ids, d.new_text, d.finish_reason, d.stop_reason,
                d.num_output_tokens, d.logprobs, round(d.cumulative_logprob or 0.0, 5))
            for k, d in out.items()}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("overlap", [False, True])
def test_same_outputs_as_the_in_process_engine(checkpoint, overlap):
    cfg = config(checkpoint, async_scheduling=overlap)
    local = drive(LLMEngine(cfg), workload(), abort_after={"greedy": 5})
    client = EngineCoreClient(cfg, threads=1)
    try:
        remote = drive(client, workload(), abort_after={"greedy": 5})
        stats = client.stats()
    finally:
        client.shutdown()
    assert client.proc.returncode == 0
    aborted = {k: v for k, v in local.items() if k[0] == "greedy"}
    local = {k: v for k, v in local.items() if k[0] != "greedy"}
    remote_aborted = {k: v for k, v in remote.items() if k[0] == "greedy"}
    remote = {k: v for k, v in remote.items() if k[0] != "greedy"}
    assert comparable(remote) == comparable(local)
    # The stop strings really cut text, across the boundary too.
    assert any(d.finish_reason == "stop" and isinstance(d.stop_reason, str)
               for d in remote.values())
    assert {k[1] for k in remote if k[0] == "beam"} == {0, 1, 2}
    assert remote[("json", 0)].new_text in ("alpha", "beta", "gamma")
    # An aborted request stops streaming and never finishes.
    for d in list(aborted.values()) + list(remote_aborted.values()):
        assert not d.finished and len(d.new_token_ids) >= 5
    assert stats["kv_blocks_total"] == 96


def test_aborts_and_stop_strings_free_the_cores_blocks(checkpoint):
    client = EngineCoreClient(config(checkpoint), threads=1)
    try:
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, stop=["e", "a", "o"])
        drive(client, [(f"r{i}", f"stop soon {i}", params, None) for i in range(4)]
              + [("long", "runs long", SamplingParams(max_tokens=200, ignore_eos=True), None)],
              abort_after={"long": 3})
        deadline = time.monotonic() + 10
        while client.stats()["kv_blocks_used"] and time.monotonic() < deadline:
            client.step()
            time.sleep(0.05)
        stats = client.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0, stats
    finally:
        client.shutdown()


def _busy(client: EngineCoreClient, n: int = 4) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(n):
        client.add_request(f"busy{i}", f"keep the core busy {i}", params)
    deadline = time.monotonic() + 60
    while not any(d.new_token_ids for d in client.step()):
        assert time.monotonic() < deadline


def test_a_killed_core_fails_its_front_end_once(checkpoint):
    failures: list[str] = []
    client = EngineCoreClient(config(checkpoint), threads=1, on_failure=failures.append)
    try:
        _busy(client)
        os.kill(client.core_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(EngineCoreError, match="SIGKILL"):
            while time.monotonic() < deadline:
                client.step()
        assert len(failures) == 1 and "SIGKILL" in failures[0], failures
        with pytest.raises(EngineCoreError):
            client.add_request("after", "too late", SamplingParams(max_tokens=2))
    finally:
        client.shutdown()


def test_a_stopped_core_is_detected_by_the_deadline_and_killed(checkpoint):
    failures: list[str] = []
    client = EngineCoreClient(config(checkpoint), threads=1, on_failure=failures.append,
                              timeout_s=1.5)
    pid = client.core_pid
    try:
        _busy(client)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(EngineCoreError, match="stopped or hung"):
            while time.monotonic() - stopped_at < 20:
                client.step()
        took = time.monotonic() - stopped_at
        assert 1.5 <= took < 6, took
        assert len(failures) == 1
        assert client.proc.poll() is not None, "the stopped core was left behind"
    finally:
        if client.proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
        client.shutdown()


def test_a_step_longer_than_the_deadline_is_not_taken_for_a_dead_core(checkpoint):
    """A healthy core in a long step (a first compile, a long prefill on a loaded host) keeps
    its front end's deadline: its beat thread says it lives. Without the beat, a 0.5 s step
    under a 0.3 s deadline killed the core (as it did to workers in two full test runs)."""
    failures: list[str] = []
    client = EngineCoreClient(config(checkpoint, simulated_device_ms=500.0), threads=1,
                              on_failure=failures.append, timeout_s=0.3)
    try:
        out = drive(client, [("slow", "a slow step", SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True), None)])
        assert out[("slow", 0)].num_output_tokens == 3
        assert not failures and client.error is None
    finally:
        client.shutdown()


def test_a_core_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception):
        EngineCoreClient(EngineConfig(model=str(tmp_path), device="cpu"), tokenizer=object(),
                         start_timeout_s=60)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_front_end_takes_its_core_within_a_second(checkpoint, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from tokenrelay.engine.config import EngineConfig
        from tokenrelay.engine.core_client import EngineCoreClient
        from tokenrelay.engine.sampling_params import SamplingParams
        c = EngineCoreClient(EngineConfig(model={str(checkpoint)!r}, device="cpu",
                             dtype="float32", num_kv_blocks=64, enforce_eager=True), threads=1)
        c.add_request("r", "busy until killed", SamplingParams(max_tokens=200, ignore_eos=True))
        c.step()
        print(c.core_pid, flush=True)
        while True:
            c.step()
    """)
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    core_pid = None
    try:
        core_pid = int(front.stdout.readline())
        assert _pid_alive(core_pid)
        front.kill()
        front.wait()
        killed = time.monotonic()
        while _pid_alive(core_pid) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        took = time.monotonic() - killed
        assert not _pid_alive(core_pid), "the core outlived its front end"
        assert took < 1.0, took
    finally:
        front.kill()
        if core_pid is not None and _pid_alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def _core_messages(monkeypatch: pytest.MonkeyPatch, request_id: str) -> list[tuple[int, int]]:
    """From now on, for each output message the core sends this process: (the adds the core
    had applied when it sent it, the tokens it carried for ``request_id``). A spy on the
    wire's one decoder, so it sees every message whatever the client does with it."""
    from tokenrelay.engine import core_wire as wire
    seen: list[tuple[int, int]] = []
    loads = wire.loads

    def spy(frame: bytes) -> tuple:
        msg = loads(frame)
        if msg[0] == wire.OUTPUTS:
            outs = wire.unpack_outputs(msg[1])
            seen.append((msg[2].adds_applied, sum(len(o.new_token_ids) for o in outs
                                                   if o.request_id == request_id)))
        return msg
    monkeypatch.setattr(wire, "loads", spy)
    return seen


def _step_until(client: EngineCoreClient, done: Any, what: str) -> list[RequestDelta]:
    """Step until ``done(deltas so far)``; the deltas."""
    got: list[RequestDelta] = []
    deadline = time.monotonic() + 60
    while not done(got):
        assert time.monotonic() < deadline, f"never: {what}"
        got += client.step()
    return got


@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_reaches_the_core_with_the_next_step_and_frees_the_request(checkpoint,
                                                                            overlap,
                                                                            monkeypatch):
    """The bound across the boundary (EngineCoreClient's docstring): after ``abort_request``
    no delta of the request comes back; the abort leaves with the next ``step()``; the core
    applies it before its next step, so no step it runs after that carries the request
    (what it ran meanwhile is dropped here); and its blocks and capacity come back."""
    client = EngineCoreClient(config(checkpoint, async_scheduling=overlap), threads=1)
    try:
        idle = client.free_capacity()
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for rid in ("victim", "other0", "other1"):
            client.add_request(rid, f"keeps streaming: {rid}", params)
        _step_until(client, lambda got: sum(len(d.new_token_ids) for d in got
                                            if d.request_id == "victim") >= 5, "5 tokens")
        seen = _core_messages(monkeypatch, "victim")
        assert client.abort_request("victim")
        client.add_request("marker", "rides with the abort", SamplingParams(max_tokens=1))
        after = client.step()
        assert not client._commands, "the abort did not leave with the next step()"
        marker = client._adds_sent      # the core's count of adds once it applied the abort
        after += _step_until(client, lambda got: sum(a >= marker for a, _ in seen) >= 5,
                             "5 core steps after the abort")
        assert [d for d in after if d.request_id == "victim"] == []
        late = [tokens for applied, tokens in seen if applied >= marker and tokens]
        assert late == [], f"the core still ran the aborted request: {seen}"
        assert not client.abort_request("victim")
        for rid in ("other0", "other1"):
            client.abort_request(rid)
        _step_until(client, lambda got: client.stats()["kv_blocks_used"] == 0
                    and not client._status.busy, "the core idle with every block free")
        stats = client.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
        # Its slot is back: at least the idle core's capacity (more once the pool's average
        # request is known to be smaller than the scheduler's first guess).
        assert client.free_capacity() >= idle
    finally:
        client.shutdown()
