"""What rank 0 hands each rank it starts, and the key a started rank checks in under.

Shared by both ends of the start (engine/parallel/launch.py, rank 0's side, and
engine/parallel/rank.py, the loop a spawned rank runs), so neither end imports the other: the
launcher is imported by the ModelRunner, and a rank's loop imports the ModelRunner.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.parallel.group import Rendezvous


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs: the resolved config (``device`` already this rank's), its
    rank, where to meet rank 0, and its share of the threads."""

    config: EngineConfig
    rank: int
    rendezvous: Rendezvous
    threads: int


def hello_key(rank: int) -> str:
    """The store key a rank sets once it is running (rank 0 waits for each)."""
    return f"hello/{rank}"
