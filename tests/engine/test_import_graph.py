"""The engine's modules import each other in one direction: no circle, read from the source.

Every import counts, wherever it stands: at the top of a module, inside a function (where a
circle hides until the rarely taken path runs it) and under ``TYPE_CHECKING``. The last never
runs, but a module that names another's types depends on it all the same, and a circle through
annotations is a circle in the design that the next runtime import closes; the worker's and the
SDK's checks count them too. (``importlib.import_module`` with a computed name, as in a package's
lazy exports, is not seen.)
"""

from __future__ import annotations

import pytest

from tests.import_boundaries import (assert_no_import_circle, circle_through, import_cycles, import_graph,
                                     isolated_import_failures)


def test_the_check_fails_naming_a_path_around_the_circle():
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert circle_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    with pytest.raises(AssertionError, match="a -> b -> c -> a"):
        assert_no_import_circle(graph)
    assert_no_import_circle({"a": {"b"}, "b": set()})


def test_the_graph_counts_imports_inside_functions_and_under_type_checking():
    graph = import_graph(["engine"])
    # engine/parallel/rank.py imports both inside functions; engine/sequence.py under TYPE_CHECKING.
    assert {"tokenrelay.engine.model_runner", "tokenrelay.engine.parallel.step"} <= \
        graph["tokenrelay.engine.parallel.rank"]
    assert "tokenrelay.engine.grammar" in graph["tokenrelay.engine.sequence"]


def test_no_import_circle_in_the_engine():
    assert_no_import_circle(import_graph(["engine"]))


@pytest.mark.timeout(180)
def test_every_engine_module_imports_as_the_first_one_loaded():
    """The same at run time: a circle of top-level imports fails only when entered from the
    right module, so each is imported first, alone."""
    assert isolated_import_failures(sorted(import_graph(["engine"])), timeout=150) == {}


# What the forward pass (engine/layers/, engine/models/) may stand on besides itself: the model's
# shape, the errors, and tensor parallelism's partition and process group.
FORWARD_PASS = ("tokenrelay.engine.layers", "tokenrelay.engine.models")
UNDER_THE_FORWARD_PASS = {"tokenrelay.engine.model_config", "tokenrelay.engine.errors",
                          "tokenrelay.engine.parallel.group",
                          "tokenrelay.engine.parallel.partition"}


def test_the_forward_pass_reaches_nothing_of_the_step_side():
    """engine/layers/ and engine/models/ compute a forward pass from the tensors they are given:
    nothing they import, directly or through another module, is the scheduler, the blocks, the
    sequences, the sampler, the ModelRunner or the engine's config."""
    graph = import_graph(["engine"])
    forward = {m for m in graph if m.startswith(FORWARD_PASS)}
    assert {"tokenrelay.engine.layers.attention", "tokenrelay.engine.models.decoder"} <= forward
    reached, todo = set(), sorted(forward)
    while todo:
        module = todo.pop()
        for name in graph[module] - reached:
            reached.add(name)
            todo.append(name)
    assert reached - forward - UNDER_THE_FORWARD_PASS == set()
