"""Lazy re-exports have one home, ``tokenrelay/_lazy.py``: every package that re-exports names
lazily (``tokenrelay``, ``engine``, ``kernels/ops.py``, ``producer_sdk``) takes its module-level
``__getattr__`` and ``__dir__`` from it rather than writing its own."""

from __future__ import annotations

import ast

import pytest

from tests.import_boundaries import OURS, ROOT
from tokenrelay._lazy import lazy_exports


def test_a_name_is_imported_when_first_read_and_kept():
    namespace: dict = {"__name__": "pkg"}
    getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"}, namespace)
    assert "sqrt" in dir_() and "sqrt" not in namespace
    import math
    assert getattr_("sqrt") is math.sqrt and namespace["sqrt"] is math.sqrt
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'cbrt'"):
        getattr_("cbrt")


def test_no_package_writes_its_own_module_getattr():
    own = []
    for top in ("tokenrelay", *OURS):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text())
            if any(isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
                   for node in tree.body):
                own.append(str(path.relative_to(ROOT)))
    assert own == []
    users = [p for p in ("tokenrelay/__init__.py", "engine/__init__.py", "kernels/ops.py",
                         "producer_sdk/__init__.py")
             if "lazy_exports(__name__" in (ROOT / p).read_text()]
    assert len(users) == 4, users
