"""The launchers never read a tensor's values on the host: on a GPU each read is a device sync,
and one per call of every layer cost ~0.57 ms a call on an H200 (issue #38). The engine checks a
step's indices once, on the host tensors it built them in (``check_step_values``).

On CPU a read cannot be seen as a sync, so the launchers run under a recorder of every torch call
that needs values on the host (``item``/``int``/``bool``, ``tolist``, data-dependent shapes),
paused while Triton's interpreter runs the kernel itself (it copies every argument to numpy).
On a GPU the GPU check runs the same calls under CUDA's sync debug mode (kernel_roofline).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tokenrelay.kernels import _validate
from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels._testing import make_case

HOST_READ_METHODS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"}


class HostReads(TorchFunctionMode):
    """Names of the torch calls that read tensor values on the host, outside Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0
        self._ops = _OpReads(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if not self.paused and name in HOST_READ_METHODS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._ops.__exit__(*exc)


class _OpReads(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if not self.owner.paused and (name in HOST_READ_OPS or bool_index):
            self.owner.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    recorder = HostReads()
    launch = interpreter.GridExecutor.__call__

    def paused_launch(self, *args, **kwargs):
        recorder.paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            recorder.paused -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", paused_launch)
    return recorder


def _every_op() -> list[tuple[str, tuple]]:
    torch.manual_seed(0)
    dec = make_case([5, 70], None, 4, 2, 32)
    pre = make_case([10, 20], [3, 20], 4, 2, 32)
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    cache = torch.randn(8, 32)
    slots = torch.tensor([0, 17, -1])
    return [
        ("store_kv", (k, k.clone(), dec.k_cache, dec.v_cache, slots)),
        ("paged_decode_attention", (dec.query, dec.k_cache, dec.v_cache, dec.block_tables,
                                    dec.seq_lens, dec.scale)),
        ("paged_prefill_attention", (pre.query, pre.k_cache, pre.v_cache, pre.block_tables,
                                     pre.seq_lens, pre.cu_seqlens_q, pre.scale)),
        ("rms_norm", (x, w, 1e-6)),
        ("fused_add_rms_norm", (x, res, w, 1e-6)),
        ("rotary", (q, k, torch.tensor([0, 5, 7]), cache, True)),
        ("silu_and_mul", (torch.randn(3, 16),)),
    ]


def test_no_launcher_reads_a_tensor_value(host_reads):
    for name, args in _every_op():
        with host_reads:
            getattr(kernels, name)(*args)
        assert host_reads.reads == [], f"{name} read values on the host: {host_reads.reads}"


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel-merge", "fused-merge"])
def test_decode_splits_read_no_tensor_value(host_reads, monkeypatch, fused):
    """Decode with its context in splits (64 tokens: the case above fits one split and stores
    directly), merged by the second kernel or in the split kernel (FUSED_MERGE), whose first
    call allocates the ticket counters: nothing of it reads a value on the host."""
    from tokenrelay.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "FUSED_MERGE", fused)
    monkeypatch.setattr(decode_attention, "_COUNTERS", {})
    monkeypatch.setattr(decode_attention, "_RETIRED", [])
    args = dict(_every_op())["paged_decode_attention"]
    for _ in range(2):                                  # allocates the counters, then reuses them
        with host_reads:
            out = kernels.paged_decode_attention(*args, num_splits=2, split_tokens=64)
        assert host_reads.reads == [], f"decode read values on the host: {host_reads.reads}"
    assert bool(decode_attention._COUNTERS) is fused
    torch.testing.assert_close(out, kernels.paged_decode_attention_ref(*args))


def test_the_debug_flag_brings_the_value_checks_back(host_reads, monkeypatch):
    """The recorder does see reads (so the test above can fail), and the flag does check."""
    monkeypatch.setattr(_validate, "DEBUG_VALUE_CHECKS", True)
    ops = dict(_every_op())
    with host_reads:
        kernels.paged_decode_attention(*ops["paged_decode_attention"])
    assert "_local_scalar_dense" in host_reads.reads and "index" in host_reads.reads
    host_reads.reads.clear()
    with host_reads:
        kernels.paged_prefill_attention(*ops["paged_prefill_attention"])
    assert "tolist" in host_reads.reads


def test_the_flag_comes_from_the_environment(monkeypatch):
    for raw, want in (("1", True), ("0", False)):
        monkeypatch.setenv(_validate.CHECKS_ENV, raw)
        assert _validate._debug_flag_from_env() is want
    monkeypatch.setenv(_validate.CHECKS_ENV, "yes")
    with pytest.raises(ValueError, match="TOKENRELAY_KERNEL_CHECKS must be 0 or 1"):
        _validate._debug_flag_from_env()


def _step_values(**over):
    args = dict(slot_mapping=torch.tensor([3, 17, -1]),
                block_tables=torch.tensor([[1, 2], [0, 0]], dtype=torch.int32),
                seq_lens=torch.tensor([20, 1], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32),
                num_blocks=4, block_size=16)
    args.update(over)
    _validate.check_step_values(**args)


def test_check_step_values_names_the_bad_index():
    _step_values()
    with pytest.raises(ValueError, match="slot_mapping has value 64 >= 64"):
        _step_values(slot_mapping=torch.tensor([3, 64, -1]))
    with pytest.raises(ValueError, match="block_tables has value 4 >= 4"):
        _step_values(block_tables=torch.tensor([[1, 4], [0, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens has value 33"):
        _step_values(seq_lens=torch.tensor([33, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="sequence 1 has 2 new tokens but seq_len 1"):
        _step_values(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="from 0 to num_tokens = 3"):
        _step_values(cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32))
    meta = torch.device("meta")
    with pytest.raises(ValueError, match="pass the host seq_lens, not one on meta"):
        _step_values(seq_lens=torch.tensor([20, 1], dtype=torch.int32, device=meta))


def test_the_engine_checks_each_step_once_on_the_host(tiny_checkpoint, monkeypatch):
    from tokenrelay.engine import LLM, SamplingParams
    from tokenrelay.engine.model_runner import ModelRunner

    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
              attention_backend="triton", num_kv_blocks=16)
    runner = llm.engine.model_runner
    calls, steps = [], []
    ops = runner.model.ops
    monkeypatch.setattr(runner.model, "ops", dataclasses.replace(
        ops, check_step=lambda **kw: calls.append(kw) or ops.check_step(**kw)))
    original = ModelRunner._device_inputs
    monkeypatch.setattr(ModelRunner, "_device_inputs",
                        lambda self, step, *rest: steps.append(step) or original(self, step, *rest))
    llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(calls) == len(steps) == 3                   # a prefill and two decodes, not per layer
    assert all(t.device.type == "cpu" for kw in calls for t in kw.values()
               if isinstance(t, torch.Tensor))
    bad_table = steps[-1].block_tables.clone()
    bad_table[0, 0] = runner.num_blocks
    with pytest.raises(ValueError, match=f"block_tables has value {runner.num_blocks}"):
        runner.run(dataclasses.replace(steps[-1], block_tables=bad_table))
    assert len(calls) == 4
