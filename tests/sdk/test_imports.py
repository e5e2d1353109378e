"""No import circle in the producer SDK or the contract it stands on: read from the source (every
import, lazy ones included), and at run time (each module imported first, alone)."""

from __future__ import annotations

import pytest

from tests.import_boundaries import import_cycles, import_graph, isolated_import_failures

PACKAGES = ["protocol", "producer_sdk"]


def test_the_cycle_check_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_sdk_or_the_contract_imports_itself_back():
    graph = import_graph(PACKAGES)
    assert {"tokenrelay.producer_sdk.client", "tokenrelay.producer_sdk.aio", "tokenrelay.protocol.fold"} <= set(graph)
    assert import_cycles(graph) == []


@pytest.mark.timeout(120)
def test_every_module_imports_as_the_first_one_loaded():
    assert isolated_import_failures(sorted(import_graph(PACKAGES))) == {}
