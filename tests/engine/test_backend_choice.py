"""The attention backend is chosen, never guessed: on a GPU, "auto" means the Triton kernels, and
kernels that cannot load are an error that names the cause (never a quiet torch path)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tokenrelay.engine.layers import ops as ops_mod
from tokenrelay.engine.layers.ops import BackendUnavailableError, get_ops


def test_auto_without_cuda_is_the_torch_path(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_ops("auto").name == "torch"
    assert get_ops("auto", compiled=True).name == "torch-compiled"


def test_auto_on_cuda_is_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_ops("auto").name == "triton"


def test_auto_on_cuda_with_kernels_that_cannot_load_names_the_cause(monkeypatch):
    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "tokenrelay.kernels.ops":
            raise ImportError("cannot import name 'CUDAProperties' from 'kernels'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops_mod.importlib, "import_module", broken)
    with pytest.raises(BackendUnavailableError, match="CUDAProperties.*attention_backend='torch'"):
        get_ops("auto")
    with pytest.raises(BackendUnavailableError, match="CUDAProperties"):
        get_ops("triton")
    assert get_ops("torch").name == "torch"     # the explicit opt-out still works
