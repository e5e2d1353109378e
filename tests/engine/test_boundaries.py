"""The engine runs without Redis: nothing in `engine` imports redis or the worker, neither in
its source (lazy imports included) nor through what its modules import at run time (a package
``__init__`` of a dependency, e.g. producer_sdk's, would show there)."""

from __future__ import annotations

import pytest

from tests.import_boundaries import (forbidden_imports, loaded_packages, module_name,
                                     package_files)

NOT_FOR_ENGINE = {"redis", "worker"}


def test_engine_source_imports_no_redis_or_worker():
    assert forbidden_imports("engine", NOT_FOR_ENGINE) == []


@pytest.mark.timeout(180)
def test_importing_every_engine_module_loads_no_redis_or_worker():
    modules = [module_name(p) for p in package_files("engine")]
    assert "tokenrelay.engine.llm_engine" in modules
    assert loaded_packages(modules) & NOT_FOR_ENGINE == set()


def test_public_names_as_vllm_users_import_them():
    """``from tokenrelay.engine import LLM, SamplingParams, BeamSearchParams`` (vLLM's spelling), and the
    engine's SamplingParams is the contract's own schema, not a copy."""
    from tokenrelay import engine
    from tokenrelay.engine.beam_search import BeamSearchParams
    from tokenrelay.protocol.sampling_params import SamplingParams

    assert engine.BeamSearchParams is BeamSearchParams
    assert engine.SamplingParams is SamplingParams
    assert {"LLM", "SamplingParams", "BeamSearchParams"} <= set(engine.__all__)
