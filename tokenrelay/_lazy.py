"""A package's lazy re-exports, written once: a name is imported from its home module the first
time it is read, and kept as a plain global from then on.

    __getattr__, __dir__ = lazy_exports(__name__, {"LLM": "tokenrelay.engine.llm"}, globals())

So importing a package for one light name loads none of the heavy ones: ``tokenrelay`` and the
producer SDK no torch, the engine's params and errors no model code, ``tokenrelay.kernels.ops``
no ``@triton.jit`` module before the interpreter is chosen. It imports nothing of ours, so every
package may use it (``protocol`` needs none: it re-exports nothing lazily).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(module: str, homes: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` (PEP 562) of ``module``, whose globals
    are ``namespace``: each name of ``homes`` is read from the module named beside it."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
