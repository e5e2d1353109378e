"""Sampling defaults from the checkpoint's generation_config.json (#40): applied where a job
leaves a field unset, as vLLM's ``--generation-config auto``; ``vllm`` turns them off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.fault_harness import enqueue, wait_for_terminal
from tokenrelay.engine.model_config import generation_defaults
from tokenrelay.engine.tiny import write_checkpoint
from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.fake_engine import fake_completion
from tokenrelay.worker.sampling_defaults import SamplingDefaults

pytestmark = pytest.mark.timeout(120)
KEYS = Keys()


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, msg: str, **kw: object) -> None:
        self.lines.append((msg, kw))

    info = warning


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose generation_config.json recommends greedy, short answers."""
    out = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-gen")
    path = out / "generation_config.json"
    gen = json.loads(path.read_text())
    gen.update(temperature=0.0, top_p=0.9, top_k=20, repetition_penalty=1.1,
               max_new_tokens=3, do_sample=False)
    path.write_text(json.dumps(gen))
    return out


def test_the_checkpoint_defaults_fill_only_what_a_job_leaves_unset(checkpoint: Path) -> None:
    assert generation_defaults(checkpoint) == {"temperature": 0.0, "top_p": 0.9, "top_k": 20,
                                               "repetition_penalty": 1.1, "max_tokens": 3}
    d = SamplingDefaults.load(WorkerSettings(model=str(checkpoint)), Log())
    assert d.apply({"temperature": 0.7}) == {"temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                             "repetition_penalty": 1.1}
    assert "repetition_penalty" not in d.apply({"beam_width": 2})   # beam search refuses it
    assert d.max_tokens_for({}) == 3 and d.max_tokens_for({"max_tokens": 9}) is None
    assert d.max_tokens_for({"min_tokens": 5}) is None               # never below min_tokens
    off = SamplingDefaults.load(WorkerSettings(model=str(checkpoint),
                                               generation_config="vllm"), Log())
    assert off.apply({}) == {} and off.max_tokens_for({}) is None
    other = SamplingDefaults.load(WorkerSettings(model="fake:",
                                                 generation_config=str(checkpoint)), Log())
    assert other.values == d.values


def test_a_bad_value_is_left_out_with_a_warning_and_a_bad_choice_is_refused(
        tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": 5}))
    log = Log()
    d = SamplingDefaults.load(WorkerSettings(model=str(tmp_path)), log)
    assert d.values == {"top_k": 5}
    assert any(kw.get("field") == "top_p" for _, kw in log.lines)
    with pytest.raises(ValidationError, match="generation_config"):
        WorkerSettings(model="m", generation_config=str(tmp_path / "nowhere"))


@pytest.mark.parametrize("choice, greedy, tokens", [("auto", True, 3), ("vllm", False, 16)])
def test_a_worker_applies_them_to_jobs(start_worker, redis_server, checkpoint: Path,
                                       choice: str, greedy: bool, tokens: int) -> None:
    r = redis_server.client()
    w = start_worker(model=str(checkpoint), generation_config=choice)
    enqueue(r, KEYS, {"v": 1, "job_id": "unset", "prompt": "hello", "stream": False,
                      "params": {"seed": 7}})
    enqueue(r, KEYS, {"v": 1, "job_id": "own", "prompt": "hello", "stream": False,
                      "params": {"seed": 7, "temperature": 1.0, "max_tokens": 5}})
    ends = wait_for_terminal(r, KEYS, ["unset", "own"])
    unset, own = ends["unset"][-1], ends["own"][-1]
    assert unset.type == "done" and own.type == "done"
    assert unset.text == fake_completion("hello", tokens, seed=7, greedy=greedy)
    assert own.text == fake_completion("hello", 5, seed=7, greedy=False)    # its own win
    assert w.stop() == 0
