"""The house rules of the runtime packages, checked: small files, small classes, one job each.

A module past ~450 lines or a class past ~300 is where two concepts start to share a home; this
fails when one grows past the bound, so it is split when it happens, not in a later cleanup.
Benchmarks, demos and tests are programs and are not held to it."""

from __future__ import annotations

import ast

import pytest

from tests.import_boundaries import ROOT, package_files

RUNTIME = ["protocol", "engine", "kernels", "worker", "producer_sdk"]
MAX_FILE_LINES = 460
MAX_CLASS_LINES = 310


def _files():
    return [p for pkg in RUNTIME for p in package_files(pkg)]


def test_no_runtime_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in _files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these modules (over {MAX_FILE_LINES} lines): {long}"


def test_no_runtime_class_is_too_long():
    long = {}
    for p in _files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long[f"{p.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}, f"split these classes (over {MAX_CLASS_LINES} lines): {long}"


@pytest.mark.parametrize("folder", ["benchmarks", "demos"])
def test_programs_live_outside_the_runtime_packages(folder):
    """No benchmark or demo module inside a runtime package (they moved to their own folders)."""
    assert (ROOT / folder / "__init__.py").exists()
    stray = [str(p.relative_to(ROOT)) for p in _files()
             if p.stem.startswith(("bench", "demo"))]
    assert stray == []
