"""engine/upload.py: a step's index tensors packed into one buffer and viewed back."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine.upload import ALIGN, pack, unpack, upload

pytestmark = pytest.mark.timeout(30)


def step_like() -> list[torch.Tensor]:
    """Odd sizes, empty ones, 2-D, int32 beside int64 and a bool: every view must land
    aligned for its dtype."""
    return [torch.arange(5), torch.zeros(0, dtype=torch.int64),
            torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.tensor([7], dtype=torch.int32),
            torch.zeros(0, 2, dtype=torch.int64), torch.tensor([True, False, True]),
            torch.arange(10, 0, -1, dtype=torch.int64)[::2]]          # not contiguous


def test_unpack_gives_back_every_tensor_exactly_as_views_of_one_buffer():
    tensors = step_like()
    packed = pack(tensors)
    assert packed.dtype == torch.uint8 and packed.numel() % ALIGN == 0
    out = unpack(packed, tensors)
    for a, b in zip(tensors, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        if b.numel():
            assert b.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
            assert b.data_ptr() % b.element_size() == 0


def test_a_cpu_device_gets_the_tensors_themselves():
    tensors = step_like()
    assert all(a is b for a, b in zip(tensors, upload(tensors, torch.device("cpu"))))


def test_wider_elements_are_refused():
    with pytest.raises(ValueError, match="wider than 8 bytes"):
        pack([torch.zeros(2, dtype=torch.complex128)])
