"""Decode attention's fused merge (kernels/decode_attention.py: FUSED_MERGE): the last program of
each (sequence, KV head) to take an atomic ticket merges its splits inside the split kernel.
It must give the two-kernel path's bits exactly, leave every ticket counter at 0 (so the next
call, and a CUDA-graph replay, start clean) and keep one counter buffer per (device, stream).

Under the interpreter programs run one after another, so races cannot show here; what can show
is a wrong ticket count (too high: nobody merges and the NaN-poisoned output stays NaN; too low:
a merge reads partials not yet written, also NaN), a counter left dirty, and any difference in
the merge's arithmetic."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.kernels import _validate
from tokenrelay.kernels import decode_attention as decode
from tokenrelay.kernels._testing import make_case
from tests.kernels.test_attention import _assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (context lengths, (Hq, Hkv), num_splits, split_tokens). Split sizes of 64 and 128 tokens give
# tables of several splits at interpreter-friendly lengths.
CASES = [
    # 1 token, exactly one split, a multiple of the split size, a ragged 4th split
    ([1, 64, 128, 200], (8, 2), 2, 64),
    # GQA 6 (padded rows), programs by occupancy (capped at the 5 splits), a zero-length sequence
    ([130, 64, 1, 0, 300], (6, 1), None, 64),
    # splits of two 64-token tiles; 3 programs, the last idle for every sequence but the longest
    ([256, 1, 129, 300], (8, 1), 3, 128),
    # GQA 1, more programs than splits (capped at 3), batch 6
    ([70, 192, 5, 64, 128, 33], (2, 2), 7, 64),
    # batch 1, GQA 4 with one KV head, one program over all 5 splits
    ([257], (4, 1), 1, 64),
]


@pytest.fixture(autouse=True)
def _poison_and_seed(monkeypatch):
    monkeypatch.setattr(_validate, "POISON_OUTPUTS", True)
    torch.manual_seed(38)


@pytest.fixture
def fresh_counters(monkeypatch):
    """Empty counter buffers, so a test sees the ones its calls allocate."""
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(decode, "_RETIRED", [])
    return decode._COUNTERS


def _decode(monkeypatch, case, fused: bool, num_splits, split_tokens) -> torch.Tensor:
    monkeypatch.setattr(decode, "FUSED_MERGE", fused)
    return decode.paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                         case.seq_lens, case.scale, num_splits=num_splits,
                                         split_tokens=split_tokens)


def _all_counters() -> list[torch.Tensor]:
    return [*decode._COUNTERS.values(), *decode._RETIRED]


def _assert_counters_zero() -> None:
    buffers = _all_counters()
    assert buffers, "the fused path allocated no counters"
    for buf in buffers:
        assert buf.dtype == torch.int32 and not buf.any(), f"counters left dirty: {buf.nonzero()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("lens,heads,num_splits,split_tokens", CASES,
                         ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_merge_equals_the_two_kernel_path(monkeypatch, fresh_counters, dtype, lens, heads,
                                                 num_splits, split_tokens):
    case = make_case(lens, None, heads[0], heads[1], 32, dtype=dtype, device=DEVICE)
    two = _decode(monkeypatch, case, False, num_splits, split_tokens)
    assert not fresh_counters                       # the two-kernel path needs no counters
    fused = _decode(monkeypatch, case, True, num_splits, split_tokens)
    _assert_close(fused, decode.paged_decode_attention_ref(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale))
    assert torch.equal(fused, two)
    _assert_counters_zero()
    again = _decode(monkeypatch, case, True, num_splits, split_tokens)
    assert torch.equal(again, fused)                # the reset counters served a second call
    _assert_counters_zero()
    assert len(fresh_counters) == 1 and not decode._RETIRED   # one buffer, reused


def test_fused_merge_with_one_split_stores_directly(monkeypatch, fresh_counters):
    """When the table's capacity fits one split the split kernel writes the output itself
    (DIRECT): there is nothing to merge, and no counter is allocated."""
    case = make_case([3, 90], None, 8, 2, 32, dtype=torch.float16, device=DEVICE)
    fused = _decode(monkeypatch, case, True, None, 512)
    assert not fresh_counters
    assert torch.equal(fused, _decode(monkeypatch, case, False, None, 512))


def test_counters_grow_keep_the_old_buffer_and_are_per_stream(monkeypatch, fresh_counters):
    """A call that needs more counters than its stream's buffer holds gets a bigger one (the old
    one kept alive: a captured graph may still use it); a call on another stream gets its own.
    Each call's result is still the two-kernel path's."""
    monkeypatch.setattr(decode, "_MIN_COUNTERS", 4)
    small = make_case([70, 130], None, 4, 2, 32, device=DEVICE)           # 2 x 2 counters
    big = make_case([70, 130, 1, 200, 64], None, 4, 2, 32, device=DEVICE)  # 5 x 2 counters
    for case in (small, small, big, small):
        fused = _decode(monkeypatch, case, True, 2, 64)
        assert torch.equal(fused, _decode(monkeypatch, case, False, 2, 64))
    (key, buf), = fresh_counters.items()
    assert key == decode._stream_key(torch.device(DEVICE))
    assert buf.numel() == 10 and [r.numel() for r in decode._RETIRED] == [4]
    _assert_counters_zero()

    monkeypatch.setattr(decode, "_stream_key", lambda device: ("elsewhere", 7))
    _decode(monkeypatch, small, True, 2, 64)
    assert set(fresh_counters) == {key, ("elsewhere", 7)}
    assert fresh_counters[key] is buf and fresh_counters[("elsewhere", 7)].numel() == 4
    _assert_counters_zero()


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel", "fused"])
def test_the_merge_paths_agree_whatever_the_programs(monkeypatch, fused):
    """Either path: a sequence's bits do not depend on how many programs share its splits."""
    case = make_case([300, 7, 129], None, 8, 2, 32, dtype=torch.float16, device=DEVICE)
    base = _decode(monkeypatch, case, False, 1, 64)
    for programs in (2, 5, None):
        assert torch.equal(_decode(monkeypatch, case, fused, programs, 64), base)
