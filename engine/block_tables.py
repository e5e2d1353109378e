"""BlockTables: every live sequence's block table, mirrored in one array, updated as the
BlockManager changes it (vLLM's persistent batch, for the tables).

Rebuilding a step's ``[S, max blocks]`` table from each sequence's Python list touched every
block of every sequence every step (and ``torch.tensor`` checked each one again): at 256
sequences that was a third of a step's input preparation. Here a sequence owns one row from
its first block to its ``free``; a new block writes one entry, a copy on write one entry, a
fork one row. A step only gathers its sequences' rows (``gather``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenrelay.engine.sequence import Sequence


class BlockTables:
    """Rows of block ids; ``Sequence.table_row`` is a sequence's row (-1: none)."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def _row(self, seq: "Sequence") -> int:
        if seq.table_row < 0:
            if not self._free_rows:
                old = self.array.shape[0]
                self.array = np.concatenate([self.array, np.zeros_like(self.array)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            seq.table_row = self._free_rows.pop()
        return seq.table_row

    def _fit(self, width: int) -> None:
        have = self.array.shape[1]
        if width > have:
            grown = np.zeros((self.array.shape[0], max(width, 2 * have)), dtype=np.int32)
            grown[:, :have] = self.array
            self.array = grown

    def extend(self, seq: "Sequence", start: int) -> None:
        """``seq.block_table[start:]`` were appended."""
        row = self._row(seq)
        end = len(seq.block_table)
        self._fit(end)
        self.array[row, start:end] = seq.block_table[start:end]

    def set(self, seq: "Sequence", index: int) -> None:
        """``seq.block_table[index]`` was replaced (copy on write)."""
        self.array[self._row(seq), index] = seq.block_table[index]

    def copy(self, parent: "Sequence", child: "Sequence") -> None:
        """``child`` holds ``parent``'s table (a fork)."""
        n = len(parent.block_table)
        if n:
            self.array[self._row(child), :n] = self.array[self._row(parent), :n]

    def release(self, seq: "Sequence") -> None:
        """The sequence's blocks were freed: its row is zeroed (padding reads as block 0, as
        it always did) and reused."""
        if seq.table_row >= 0:
            self.array[seq.table_row] = 0
            self._free_rows.append(seq.table_row)
            seq.table_row = -1

    def gather(self, seqs: list["Sequence"]) -> torch.Tensor:
        """``[len(seqs), widest table]`` int32, rows in ``seqs`` order, zero-padded."""
        width = max(len(s.block_table) for s in seqs)
        rows = np.fromiter((s.table_row for s in seqs), dtype=np.int64, count=len(seqs))
        return torch.from_numpy(self.array[rows, :width])

    def row(self, seq: "Sequence") -> list[int]:
        """A sequence's mirrored table (for checks)."""
        if seq.table_row < 0:
            return []
        return self.array[seq.table_row, :len(seq.block_table)].tolist()
