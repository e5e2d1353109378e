"""CUDA-graph replay of decode steps (triton backend on CUDA only).

Why: a decode step launches a few kernels per layer on tiny tensors, so at small batch the GPU
waits on Python and launch latency. The decoder forward is captured once per batch size — 1, 2,
4, 8, then every multiple of 16 up to max_num_seqs — and replayed; a batch is padded up to the
next captured size and larger batches run eagerly.

What makes capture legal: the inputs live in static buffers that each step overwrites; padding
rows get slot -1 (store_kv skips them) and seq_len 0 (decode attention reads nothing and writes
zeros); the block table always has max_model_len / block_size columns so every shape is fixed;
the `kernels` launchers read no tensor value (the ModelRunner checks a step's indices on the host)
and pick num_splits from shapes alone. Prefill and mixed steps are never captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenrelay.engine.layers.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, all <= max_num_seqs."""
    small = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    return small + list(range(16, max_num_seqs + 1, 16))


class DecodeGraphRunner:
    """Static decode inputs + one replayable forward per captured batch size."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks_per_seq
        n = self.sizes[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.seq_lens = torch.zeros(n, **i32)
        self.context_lens = torch.zeros(n, **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self._replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_blocks, is_decode=True)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._meta(size),
                          self.kv_caches)

    def _record(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm up (compiles the kernels for these shapes), then capture one forward."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Captured on the warm-up stream: what a kernel keeps per stream (decode attention's
        # merge counters, kernels/decode_attention.py) was made while warming up, not in the graph.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self._forward(size)
        self._pool = graph.pool()
        return graph.replay, out

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so the smaller graphs fit in the memory the first one pooled.
        The buffers hold padding (slot -1, seq_len 0) here, so capture touches no KV data."""
        for size in reversed(self.sizes):
            self._replays[size] = self._record(size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [B, H] by replay, or None when this step must run eagerly."""
        b = input_ids.shape[0]
        size = next((s for s in self.sizes if s >= b), None)
        width = meta.block_tables.shape[1]
        if size is None or size not in self._replays or width > self.max_blocks:
            return None
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:size].fill_(0)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        replay, out = self._replays[size]
        replay()
        return out[:b]
