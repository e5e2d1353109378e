"""Which packages a package of this repository imports, read two ways, for the boundary tests.

- From the source (``ast``): every ``import``/``from ... import`` anywhere in a module (inside
  functions too, where lazy imports hide) and every ``importlib.import_module("literal")``.
  This catches an import that only a rarely taken path would run.
- At run time, in a fresh interpreter: the top-level packages in ``sys.modules`` after
  importing given modules. This catches what a dependency drags in (a package ``__init__``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The design's folders, installed as tokenrelay.<folder> (pyproject.toml's package-dir).
OURS = ("protocol", "engine", "kernels", "worker", "producer_sdk")


def package_of(name: str) -> str:
    """The package a module name belongs to, in the terms the boundary tests use: one of ours
    (``tokenrelay.engine.llm`` -> ``engine``) or a distribution's top-level name (``redis``)."""
    parts = name.split(".")
    if parts[0] == "tokenrelay" and len(parts) > 1 and parts[1] in OURS:
        return parts[1]
    return parts[0]


def package_files(package: str) -> list[Path]:
    """Every ``.py`` file of a top-level package folder of the repository."""
    files = sorted((ROOT / package).rglob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python files under {ROOT / package}")
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in OURS:
        parts = ("tokenrelay", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports stay inside the
    package and are left out)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def forbidden_imports(package: str, forbidden: set[str]) -> list[str]:
    """``"kernels/bench.py imports engine.llm_engine"`` for each import of a forbidden
    top-level package found in the package's source."""
    found = []
    for path in package_files(package):
        for name in sorted(imported_names(path)):
            if package_of(name) in forbidden:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def loaded_packages(modules: list[str], timeout: float = 120) -> set[str]:
    """Top-level packages loaded after a fresh interpreter imports ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"importing {modules} failed:\n{done.stderr[-2000:]}")
    return {package_of(n) for n in json.loads(done.stdout.strip().splitlines()[-1])}


def _resolve(name: str, imported: list[str], modules: set[str]) -> list[str]:
    """The repository modules an ``import``/``from name import imported`` statement loads:
    ``name`` (when it is one) and each ``name.x`` that is a module itself."""
    out = [name] if name in modules else []
    out += [f"{name}.{x}" for x in imported if f"{name}.{x}" in modules]
    return out


def import_graph(packages: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, anywhere in its source (lazy imports
    inside functions included: a circle hidden behind one is still a circle)."""
    paths = {module_name(p): p for package in packages for p in package_files(package)}
    modules = set(paths)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    graph[mod].update(_resolve(alias.name, [], modules))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                graph[mod].update(_resolve(node.module, [a.name for a in node.names], modules))
        graph[mod].discard(mod)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: each strongly connected set of two or more modules, sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


def circle_through(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One closed path through a circle that ``import_cycles`` found: from its first module,
    breadth first inside the circle, back to that module (``[a, b, c, a]``)."""
    start, inside = members[0], set(members)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        reached = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    back = [node]
                    while back[-1] != start:
                        back.append(came_from[back[-1]])
                    return [*reversed(back), start]
                if child not in came_from:
                    came_from[child] = node
                    reached.append(child)
        frontier = reached
    raise ValueError(f"no circle through {members}")


def assert_no_import_circle(graph: dict[str, set[str]]) -> None:
    """Fail naming one path around each circle of ``graph``, ``a -> b -> c -> a``, and every
    module caught in it."""
    paths = [" -> ".join(circle_through(graph, members)) + f"  (all in it: {', '.join(members)})"
             for members in import_cycles(graph)]
    assert not paths, "import circles (lazy imports count):\n  " + "\n  ".join(paths)


def isolated_import_failures(modules: list[str], timeout: float = 120) -> dict[str, str]:
    """Module -> error, for each of ``modules`` that fails to import as the first module of
    the repository loaded (one interpreter; the repository's modules are unloaded between
    imports, third-party ones stay): an import circle shows up as an ImportError only when it
    is entered from the right module, so every entry point is tried."""
    roots = sorted({m.split(".")[0] for m in modules})
    code = ("import importlib, json, sys\n"
            f"roots = {roots!r}\n"
            "failed = {}\n"
            f"for m in {modules!r}:\n"
            "    for name in [n for n in sys.modules if n.split('.')[0] in roots]:\n"
            "        del sys.modules[name]\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as exc:\n"
            "        failed[m] = f'{type(exc).__name__}: {exc}'\n"
            "print(json.dumps(failed))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the import check itself failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
