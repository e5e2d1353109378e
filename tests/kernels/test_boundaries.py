"""`kernels` knows nothing of the packages above it: the engine imports the kernels (lazily, as
its "triton" backend), never the other way round, and the worker and the producer SDK are
further still. Read from the source, so a lazy import inside a function counts too."""

from __future__ import annotations

from tests.import_boundaries import forbidden_imports, imported_names, package_files

ABOVE_KERNELS = {"engine", "worker", "producer_sdk"}


def test_kernels_import_nothing_from_engine_worker_or_sdk():
    assert forbidden_imports("kernels", ABOVE_KERNELS) == []


def test_the_source_scan_sees_lazy_and_importlib_imports(tmp_path):
    """The scan itself: imports inside functions and importlib.import_module("...") count."""
    src = tmp_path / "mod.py"
    src.write_text("import importlib\n"
                   "def f():\n    from tokenrelay.engine.llm_engine import LLMEngine\n"
                   "def g():\n    return importlib.import_module('tokenrelay.worker.service')\n"
                   "from . import sibling\n")
    assert imported_names(src) == {"importlib", "tokenrelay.engine.llm_engine", "tokenrelay.worker.service"}
    assert len(package_files("kernels")) > 5
