"""The contract package stands under everything: it imports nothing of the engine, the worker or
the producer SDK, and no torch or FastAPI, neither in its source (lazy imports included) nor
through what its modules import at run time."""

from __future__ import annotations

import pytest

from tests.import_boundaries import (forbidden_imports, loaded_packages, module_name,
                                     package_files)

NOT_FOR_PROTOCOL = {"engine", "worker", "producer_sdk", "kernels", "torch", "fastapi",
                    "transformers", "triton", "benchmarks", "demos"}


def test_protocol_source_imports_nothing_above_it():
    assert forbidden_imports("protocol", NOT_FOR_PROTOCOL) == []


@pytest.mark.timeout(120)
def test_importing_every_protocol_module_loads_nothing_above_it():
    modules = [module_name(p) for p in package_files("protocol")]
    assert {"tokenrelay.protocol.wire", "tokenrelay.protocol.keys", "tokenrelay.protocol.fold"} <= set(modules)
    assert loaded_packages(modules) & NOT_FOR_PROTOCOL == set()


@pytest.mark.timeout(120)
def test_engine_imports_no_client_sdk():
    """The engine stands on the contract, beside the SDK, not on it."""
    assert forbidden_imports("engine", {"producer_sdk", "redis"}) == []
    modules = [module_name(p) for p in package_files("engine")]
    assert loaded_packages(modules) & {"producer_sdk", "redis", "worker"} == set()


def test_worker_imports_the_client_sdk_only_in_its_tools():
    """The worker knows the engine and the contract; the client SDK only where a worker tool is a
    producer itself (none today)."""
    assert forbidden_imports("worker", {"producer_sdk"}) == []
