"""ModelRunner: owns the weights and the paged KV cache, turns a schedule into one forward pass.

The batch is flattened and ragged, with no padding: the new tokens of every scheduled sequence
are concatenated into ``input_ids[T]``/``positions[T]``; ``cu_seqlens_q`` marks where each
sequence's span starts; ``slot_mapping[T]`` says where each new token's K/V goes in the cache
(``block_table[pos // block_size] * block_size + pos % block_size``). Only the last position of
each sequence that completes its tokens this step reaches the LM head; chunked-prefill pieces
that do not finish their prompt skip it. How the batch splits for attention (decode groups,
prefill sequences) is planned once here per step and carried to every layer in the metadata.

A step is prepared on the host as :class:`StepInputs` and then run (:meth:`ModelRunner.run`).
With ``tensor_parallel_size > 1`` this runner is rank 0: it starts the other ranks
(engine/parallel/launch.py), sends each step's inputs to them before running it, and gets the
whole vocabulary's logits back from the gather in the LM head; every other rank runs the same
class, fed by engine/parallel/rank.py. At size 1 none of that exists: no process group, no
collective, the step runs as it is prepared.
"""

from __future__ import annotations

import weakref
from array import array
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from tokenrelay.engine.config import ACTIVATION_BYTES_PER_TOKEN, CudaMemory, EngineConfig, gpu_kv_budget
from tokenrelay.engine.layers.attention import AttentionMetadata
from tokenrelay.engine.parallel.partition import Partition
from tokenrelay.engine.block_tables import BlockTables
from tokenrelay.engine.sequence import Sequence
from tokenrelay.engine.step_inputs import Placeholders, StepInputs
from tokenrelay.engine.upload import upload

if TYPE_CHECKING:
    from tokenrelay.engine.simulated import SimulatedStream


def _ints(values: list[int]) -> torch.Tensor:
    """int64 host tensor from a list, through the ``array`` module: ``torch.tensor`` checks
    each element's type and took several times longer for a step's 256 ids."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else \
        torch.zeros(0, dtype=torch.int64)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Optional[Any] = None,
                 group: Optional[Any] = None,
                 on_parallel_failure: Optional[Callable[[str], None]] = None,
                 tables: Optional[BlockTables] = None) -> None:
        """``group``: this rank's ``ParallelGroup`` when it is not rank 0 (engine/parallel/
        rank.py passes it); rank 0 of a tensor-parallel engine starts the other ranks itself and
        calls ``on_parallel_failure`` (see engine/parallel/launch.py) if one of them fails.
        ``tables``: the block tables the BlockManager keeps (rank 0, which prepares steps)."""
        self.config = config
        self.tables = tables
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.ranks = None
        if config.tensor_parallel_size > 1 and group is None:
            if model is not None:
                raise ValueError("an injected model cannot be tensor-parallel; "
                                 "pass tensor_parallel_size=1")
            from tokenrelay.engine.parallel.launch import launch_ranks
            self.ranks = launch_ranks(config, on_parallel_failure)
            group = self.ranks.group
        self.group = group
        try:
            self._load(config, model)
        except BaseException as exc:
            if self.ranks is None:
                raise
            error = self.ranks.abort_start(exc)
            if error is exc:
                raise
            raise error from exc
        if self.ranks is not None:
            self.ranks.ready()
            weakref.finalize(self, self.ranks.shutdown)     # an engine dropped unshut

    def _load(self, config: EngineConfig, model: Optional[Any]) -> None:
        group = self.group
        before = self._cuda_memory()                 # None on CPU
        if model is None and config.simulated_device_ms is not None:
            from tokenrelay.engine.simulated import SimulatedDeviceModel
            model = SimulatedDeviceModel(config.hf_config.vocab_size,
                                         config.simulated_device_ms / 1000.0)
        if model is None:
            from tokenrelay.engine.loader import load_model
            model = load_model(config.model, dtype=config.dtype, device=config.device,
                               backend=config.attention_backend,
                               compiled=self._wants_compiled(), group=group)
        self.model = model
        if (self.device.type == "cpu" and config.cpu_prepack_weights
                and hasattr(model, "prepack_cpu_weights")):      # injected test models may not
            model.prepack_cpu_weights(config.cpu_gemm_backend)
        self.num_blocks = config.num_kv_blocks_for(self._free_bytes_for_kv(before))
        if group is not None:                   # every rank's pool holds the same blocks
            self.num_blocks = group.min_int(self.num_blocks)
        c = config.hf_config
        part = Partition.of(c, group.rank, group.size) if group is not None else None
        kv_heads = part.num_kv_heads if part is not None else c.num_key_value_heads
        cache_shape = (self.num_blocks, self.block_size, kv_heads, c.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(cache_shape, dtype=config.dtype, device=self.device),
             torch.zeros(cache_shape, dtype=config.dtype, device=self.device))
            for _ in range(c.num_hidden_layers)
        ]
        self.decode_graphs = self._maybe_capture_decode_graphs()
        with torch.inference_mode():
            self._warm_up_compiled()

    @property
    def simulated_stream(self) -> Optional["SimulatedStream"]:
        """The simulated device's stream when the model is simulated (engine/simulated.py):
        the overlapped core launches on it as it would on a CUDA stream."""
        from tokenrelay.engine.simulated import SimulatedDeviceModel
        return self.model.stream if isinstance(self.model, SimulatedDeviceModel) else None

    def _wants_compiled(self) -> bool:
        """CPU float32 without ``enforce_eager``: decode attention and Q/K norm + RoPE through
        inductor kernels (engine/layers/compiled_decode.py, engine/layers/compiled_rope.py)."""
        return (self.device.type == "cpu" and self.config.dtype == torch.float32
                and not self.config.enforce_eager)

    def _warm_up_compiled(self) -> None:
        """A one-token decode forward that stores nothing (slot -1), so compiling (seconds, once
        per process and model shape) happens at start-up and not in a request. A host that
        cannot compile falls back to the eager path here, with a warning. (Every rank of a
        tensor-parallel engine runs it at the same point of its start-up: it all-reduces.)"""
        if getattr(getattr(self.model, "ops", None), "name", None) != "torch-compiled":
            return
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([-1]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
            seq_lens=torch.ones(1, dtype=torch.int32),
            context_lens=torch.zeros(1, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=1,
            is_decode=True)
        self.model(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                   self._with_plan(meta), self.kv_caches)

    def _maybe_capture_decode_graphs(self) -> Optional[Any]:
        """CUDA graphs for decode steps: CUDA, the triton backend, not ``enforce_eager``, and
        one rank (captured collectives are not supported here)."""
        ops = getattr(self.model, "ops", None)
        if (self.device.type != "cuda" or getattr(self.config, "enforce_eager", False)
                or getattr(ops, "name", None) != "triton" or self.group is not None):
            return None
        from tokenrelay.engine.layers.cuda_graphs import DecodeGraphRunner
        max_blocks = -(-int(self.config.max_model_len) // self.block_size)
        graphs = DecodeGraphRunner(self.model, self.kv_caches, self.config.max_num_seqs,
                                   max_blocks, self.device)
        graphs.capture()
        return graphs

    def _cuda_memory(self) -> Optional[CudaMemory]:
        """The device's memory now (None on CPU); read before and after loading the weights."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return CudaMemory(total=total, free=free,
                          reserved=torch.cuda.memory_reserved(self.device))

    def _free_bytes_for_kv(self, before: Optional[CudaMemory]) -> Optional[int]:
        """CUDA: this engine's share (``gpu_memory_utilization``) less what it already uses;
        CPU: None (the config's fixed budget applies)."""
        if before is None:
            return None
        activations = self.config.max_num_batched_tokens * ACTIVATION_BYTES_PER_TOKEN
        return gpu_kv_budget(self.config.gpu_memory_utilization, before, self._cuda_memory(),
                             activations)

    def _with_plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Build the step's attention plan once, here, for every layer to read from ``meta``
        (None for ops that take none, and for injected models without an op table)."""
        ops = getattr(self.model, "ops", None)
        if ops is not None:
            meta.plan = ops.plan_step(meta, self.block_size, self.config.dtype)
        return meta

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                block_copies: Optional[list[tuple[int, int]]] = None,
                all_logits: bool = False) -> tuple[StepInputs, list[int]]:
        """The step's inputs on the host, and ``sample_rows``: the indexes into ``seqs`` that
        get a token this step. ``all_logits``: logits at every new token (teacher forcing)
        instead of only at the last of each sequence that completes its tokens."""
        bs = self.block_size
        is_decode = all(n == 1 for n in num_new_tokens)
        if self.tables is None:
            raise RuntimeError("this ModelRunner prepares no steps (a tensor-parallel rank)")
        block_tables = self.tables.gather(seqs)
        if is_decode:
            input_ids = [s.token_ids[-1] for s in seqs]
            positions = _ints([s.num_computed_tokens for s in seqs])
            slot_mapping = (block_tables.gather(1, (positions // bs)[:, None]).squeeze(1)
                            .to(torch.int64) * bs + positions % bs)
            context_lens = positions.to(torch.int32)
            seq_lens_t = (positions + 1).to(torch.int32)
            seq_lens = None
            cu = torch.arange(len(seqs) + 1, dtype=torch.int32)
            sample_rows = list(range(len(seqs)))
            last = torch.arange(len(seqs), dtype=torch.int64)
            max_q = 1
            max_k = int(seq_lens_t.max())
        else:
            input_ids: list[int] = []
            starts: list[int] = []
            seq_lens = []
            sample_rows = []
            last_idx: list[int] = []
            total = 0
            for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
                c = s.num_computed_tokens
                input_ids.extend(s.token_ids[c:c + n])
                starts.append(c)
                seq_lens.append(c + n)
                total += n
                if c + n == s.num_tokens:
                    sample_rows.append(i)
                    last_idx.append(total - 1)
            q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
            start_t = torch.tensor(starts, dtype=torch.int64)
            rows = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
            cu64 = torch.zeros(len(seqs) + 1, dtype=torch.int64)
            torch.cumsum(q_lens, 0, out=cu64[1:])
            positions = start_t[rows] + (torch.arange(total) - cu64[:-1][rows])
            slot_mapping = (block_tables[rows, positions // bs].to(torch.int64) * bs
                            + positions % bs)
            context_lens = start_t.to(torch.int32)
            seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
            cu = cu64.to(torch.int32)
            last = torch.tensor(last_idx, dtype=torch.int64)
            max_q = max(num_new_tokens)
            max_k = max(seq_lens)
        if all_logits:
            last = torch.arange(len(input_ids), dtype=torch.int64)
        copies = torch.tensor(block_copies or [], dtype=torch.int64).reshape(-1, 2)
        step = StepInputs(
            input_ids=_ints(input_ids), positions=positions,
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens_t,
            context_lens=context_lens, cu_seqlens_q=cu, logits_indices=last,
            block_copies=copies, max_seqlen_q=max_q, max_seqlen_k=max_k,
            is_decode=is_decode)
        return step, sample_rows

    def _check_step(self, step: StepInputs) -> None:
        """The step's index values, checked once on the host copies, for ops that never read
        them on the device (the triton kernels: a sync per layer there)."""
        check = getattr(getattr(self.model, "ops", None), "check_step", None)
        if check is not None:
            check(slot_mapping=step.slot_mapping, block_tables=step.block_tables,
                  seq_lens=step.seq_lens, cu_seqlens_q=step.cu_seqlens_q,
                  num_blocks=self.num_blocks, block_size=self.block_size)

    def _device_inputs(self, step: StepInputs, fill: Optional[Placeholders] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, meta with the step's plan, logits indices) on the device, in
        one host-to-device copy (engine/upload.py); ``fill`` writes the previous step's
        sampled ids where the host had placeholders."""
        self._check_step(step)
        host = [step.slot_mapping, step.block_tables, step.seq_lens, step.context_lens,
                step.cu_seqlens_q, step.input_ids, step.positions, step.logits_indices]
        if fill is not None:
            host += [fill.dst, fill.src]
        slots, tables, seq_lens, context_lens, cu, ids, positions, last, *rows = \
            upload(host, self.device)
        meta = self._with_plan(AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            context_lens=context_lens, cu_seqlens_q=cu, max_seqlen_q=step.max_seqlen_q,
            max_seqlen_k=step.max_seqlen_k, is_decode=step.is_decode,
        ))
        if fill is not None:
            ids[rows[0]] = fill.source[rows[1]]
        return ids, positions, meta, last

    @torch.inference_mode()
    def copy_blocks(self, copies: torch.Tensor) -> None:
        """Copy on write: block ``dst`` gets ``src``'s K and V in every layer, before the step
        writes into ``dst`` (a forked choice's first token in a shared, partly filled block).
        ``copies``: ``[C, 2]`` (src, dst) rows."""
        if copies.numel() == 0:
            return
        src = copies[:, 0].to(self.device, non_blocking=True)
        dst = copies[:, 1].to(self.device, non_blocking=True)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    @torch.inference_mode()
    def run(self, step: StepInputs, fill: Optional[Placeholders] = None
            ) -> Optional[torch.Tensor]:
        """The step's copy-on-write copies, then its forward pass. Returns the logits of the
        step's ``logits_indices`` (``[L, vocab]`` float32), or None when it has none or this is
        not rank 0. ``fill``: input ids that are still on the device (the overlapped core's,
        engine/overlap.py)."""
        self.copy_blocks(step.block_copies)
        ids, positions, meta, last = self._device_inputs(step, fill)
        hidden = None
        if meta.is_decode and self.decode_graphs is not None:
            hidden = self.decode_graphs.run(ids, positions, meta)
        if hidden is None:
            hidden = self.model(ids, positions, meta, self.kv_caches)
        if last.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[last])
        return None if logits is None else logits.float()

    def execute(self, seqs: list[Sequence], num_new_tokens: list[int],
                block_copies: Optional[list[tuple[int, int]]] = None, *,
                all_logits: bool = False) -> tuple[Optional[torch.Tensor], list[int]]:
        """Prepare and run one step (on every rank). Returns (logits[N, vocab] float32 or None,
        sample_rows); see :meth:`prepare` for ``all_logits``. A tensor-parallel step that fails
        anywhere raises ``TensorParallelError``: the ranks are out of step, so the engine is
        unusable from then on."""
        step, sample_rows = self.prepare(seqs, num_new_tokens, block_copies, all_logits)
        if self.ranks is None:
            return self.run(step), sample_rows
        try:
            self.ranks.send(step)
            return self.run(step), sample_rows
        except BaseException as exc:
            error = self.ranks.failed(exc)
            if not isinstance(exc, Exception):      # KeyboardInterrupt and the like go on
                raise
            raise error from exc

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do at size 1)."""
        if self.ranks is not None:
            self.ranks.shutdown()
