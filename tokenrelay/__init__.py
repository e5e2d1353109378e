"""tokenrelay: LLM inference where a Redis Streams queue is the front door.

    from tokenrelay import LLM, SamplingParams          # the engine, offline (needs torch)
    from tokenrelay import Client, AsyncClient          # producers (no torch)

Everything we install lives under this one import name: ``tokenrelay.engine``,
``tokenrelay.kernels``, ``tokenrelay.worker``, ``tokenrelay.producer_sdk`` and
``tokenrelay.protocol``. pyproject.toml maps those subpackages onto the design's folders at the
top of the repository (``package-dir``), so a wheel holds ``tokenrelay/engine/...`` and a
checkout keeps ``engine/`` where it is. ``kernels/`` has no ``__init__.py``: it is a namespace
portion, so a bare ``import kernels`` (Hugging Face's package, which transformers imports) never
finds ours, not even from the repository root. The public names below load lazily: importing
``tokenrelay`` (or ``Client``) loads no torch.
"""

from __future__ import annotations

import os

from tokenrelay._lazy import lazy_exports

__version__ = "0.1.0"


def _checkout_root() -> str | None:
    """The repository root when this file is the checkout's ``tokenrelay/`` (an editable install
    or the tree on PYTHONPATH), else None (a wheel: the subpackages sit beside this file).

    setuptools' editable finder maps each mapped subpackage to its folder but cannot find a
    namespace portion (``kernels/``) below a regular package, so in a checkout the subpackages
    are found through the root on ``__path__`` instead: the same folders the wheel copies."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    markers = ("pyproject.toml", os.path.join("engine", "__init__.py"), os.path.join("kernels", "ops.py"))
    return root if all(os.path.isfile(os.path.join(root, m)) for m in markers) else None


_ROOT = _checkout_root()
if _ROOT is not None and _ROOT not in __path__:
    __path__.append(_ROOT)

_LAZY = {
    "LLM": "tokenrelay.engine",
    "LLMEngine": "tokenrelay.engine",
    "EngineConfig": "tokenrelay.engine",
    "BeamSearchParams": "tokenrelay.engine",
    "RequestOutput": "tokenrelay.engine",
    "SamplingParams": "tokenrelay.protocol.sampling_params",
    "StructuredOutputsParams": "tokenrelay.protocol.sampling_params",
    "Client": "tokenrelay.producer_sdk",
    "AsyncClient": "tokenrelay.producer_sdk",
    "Job": "tokenrelay.producer_sdk",
    "AsyncJob": "tokenrelay.producer_sdk",
    "Limits": "tokenrelay.protocol.limits",
    "QueueFull": "tokenrelay.producer_sdk",
    "JobFailed": "tokenrelay.producer_sdk",
    "JobNotFound": "tokenrelay.producer_sdk",
    "InvalidRequest": "tokenrelay.producer_sdk",
}

__all__ = ["__version__", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
