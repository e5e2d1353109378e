"""Suite-wide setup. Fixtures live in plugin modules, one per area, so areas do not collide here."""

from __future__ import annotations

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Triton's interpreter must be chosen before any @triton.jit module is imported.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = [
    "tests.fixtures_models",
    "tests.fixtures_redis",
]
