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


def package_files(package: str) -> list[Path]:
    """Every ``.py`` file of a top-level package folder of the repository."""
    files = sorted((ROOT / package).rglob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python files under {ROOT / package}")
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
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
            if name.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def loaded_packages(modules: list[str], timeout: float = 120) -> set[str]:
    """Top-level packages loaded after a fresh interpreter imports ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"importing {modules} failed:\n{done.stderr[-2000:]}")
    return set(json.loads(done.stdout.strip().splitlines()[-1]))
