"""The worker's modules import each other in one direction: no circle, counting every import
of the source (inside functions and ``TYPE_CHECKING`` blocks too, where a circle hides)."""

from __future__ import annotations

from tests.import_boundaries import imported_names, module_name, package_files


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from p import m`` counts ``p.m``)."""
    files = package_files(package)
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        names = imported_names(path)
        graph[module_name(path)] = {n for n in names if n in modules} - {module_name(path)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle found by a depth-first walk (each reported once, from its first module)."""
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def test_the_cycle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_worker():
    graph = import_graph("worker")
    assert "tokenrelay.worker.entries" in graph["tokenrelay.worker.pending"] and "tokenrelay.worker.pending" in graph[
        "tokenrelay.worker.affinity"]
    assert cycles(graph) == []
