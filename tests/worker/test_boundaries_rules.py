"""One declaration per rule (issue #41): the job limits are declared in ``protocol/limits.py``
alone and the worker's flags are generated from them; the default ``max_tokens`` is one
function of the contract; the engine knobs the worker forwards follow ``EngineConfig``."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from tests.import_boundaries import ROOT
from tokenrelay.protocol.budget import completion_tokens
from tokenrelay.protocol.limits import DEFAULT_LIMITS, Limits
from tokenrelay.protocol.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from tokenrelay.protocol.settings import env_of, flag_of
from tokenrelay.worker.config import WorkerRun, WorkerSettings, build_parser


def _declared_fields(path) -> dict[str, str]:
    """Field name -> class, for every annotated name in a class body of ``path``."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out[stmt.target.id] = f"{path.relative_to(ROOT)}:{node.name}"
    return out


def test_no_limit_is_declared_outside_protocol_limits():
    """The worker and the SDK read Limits; none re-declares one of its fields."""
    limits = set(Limits.model_fields)
    again = {}
    for top in ("worker", "producer_sdk", "protocol"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "protocol" / "limits.py":
                continue
            again.update({name: where for name, where in _declared_fields(path).items()
                          if name in limits})
    assert again == {}


def test_the_workers_limit_settings_are_exactly_limits_fields():
    generated = set(WorkerSettings.model_fields) - set(WorkerRun.model_fields) \
        - {"log_level", "log_prompts"}
    assert generated == set(Limits.model_fields)
    for name, field in Limits.model_fields.items():
        setting = WorkerSettings.model_fields[name]
        assert (setting.default, setting.description, setting.metadata) == \
            (field.default, field.description, field.metadata), name
    assert WorkerSettings().decode_limits() == DEFAULT_LIMITS


def test_every_limit_has_its_flag_and_variable(monkeypatch):
    help_text = build_parser().format_help()
    for name in Limits.model_fields:
        assert flag_of(name) in help_text and env_of(name) == f"TOKENRELAY_{name.upper()}"
    monkeypatch.setenv("TOKENRELAY_MAX_TOOLS_BYTES", "1KiB")
    assert WorkerSettings().decode_limits().max_tools_bytes == 1024


@pytest.mark.parametrize("chat,prompt", [(False, 10), (True, 10), (True, 9000)])
def test_the_budget_counts_the_default_the_worker_gives(chat, prompt):
    """What a job without max_tokens costs is what the worker lets it generate (floored at 0
    for the budget, at 1 for the engine)."""
    from tokenrelay.worker.admission import resolve_max_tokens
    from tokenrelay.protocol.wire import JobRequest
    request = JobRequest.model_validate(
        {"job_id": "j", **({"messages": [{"role": "user", "content": "x"}]} if chat
                           else {"prompt": "x"})})
    params = SamplingParams()
    resolve_max_tokens(params, request, prompt, 8192)
    assert completion_tokens({}, prompt, chat, 8192) == max(0, 8192 - prompt if chat
                                                               else DEFAULT_MAX_TOKENS)
    assert params.max_tokens == max(1, completion_tokens({}, prompt, chat, 8192))


def test_the_engine_knobs_follow_engine_configs_fields():
    from tokenrelay.engine.config import EngineConfig
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = WorkerSettings(model="m", device="cpu", max_num_seqs=3, block_size=8,
                              enforce_eager=True, grammar_compile_threads=1)
    kw = settings.engine_kwargs()
    assert set(kw) <= engine
    shared = {n for n in engine & set(WorkerSettings.model_fields)
              if getattr(settings, n) is not None}
    assert shared <= set(kw)
