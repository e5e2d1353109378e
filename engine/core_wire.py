"""The messages between a front end (engine/core_client.py) and an engine core in its own
process (engine/core_process.py), and their one serialization.

A message is one pickle (protocol 5) of a tuple whose first item names it, sent as one frame
on a local socket pair (``multiprocessing.connection.Connection``: length-prefixed). Outputs
are ``CoreOutput`` named tuples sent as plain tuples: a step of 256 choices pickles and
loads in well under a millisecond.
Only what changed crosses: the front end sends commands (add, abort, a stop string's finish)
batched once per step; the core sends each step's outputs, with its free capacity and, at
most every ``STATS_EVERY_S``, its statistics.

front -> core:  (COMMANDS, [(ADD, CoreRequest) | (ABORT, id) | (FINISH, id, index, stop)])
                (STOP,)                                      drain nothing, exit 0
core -> front:  (READY, CoreInfo)                            once, after the model loaded
                (OUTPUTS, [CoreOutput as a tuple], Status)            a step's outputs (maybe none)
                (FAILED, message, request_ids)               a step raised; the core exits
                (ALIVE,)                                     the process runs (a long step)
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Optional

from tokenrelay.engine.outputs import CoreOutput


COMMANDS, STOP, READY, OUTPUTS, FAILED = "commands", "stop", "ready", "outputs", "failed"
ALIVE = "alive"
ADD, ABORT, FINISH = "add", "abort", "finish"

# The core's statistics ride along with its outputs at most this often.
STATS_EVERY_S = 0.5
# An idle or waiting core still says it is alive this often (the front end's deadline for a
# wedged core counts from the last message); during a long step (a first compile, a long
# prefill) a thread of its own says it, at most this long after the last message.
ALIVE_EVERY_S = 0.1


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs of a core it did not build: the resolved config (its limits
    check requests), the pool's shape and the first statistics."""

    config: Any
    vocab_size: int
    num_blocks: int
    block_size: int
    pid: int
    free_capacity: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class Status:
    """The core after a step: its free capacity, how many adds it has applied (so the front
    end counts those in flight), whether it has work, and its statistics when due."""

    free_capacity: int
    adds_applied: int
    busy: bool
    stats: Optional[dict[str, Any]] = None


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=5)


def loads(frame: bytes) -> tuple:
    return pickle.loads(frame)


def pack_outputs(outs: list[CoreOutput]) -> list[tuple]:
    """Outputs as plain tuples: pickle takes a named tuple apart through ``__reduce__``, one
    call per output, which doubled a 256-choice step's round trip (1.24 ms vs 0.66 ms)."""
    return [tuple(o) for o in outs]


def unpack_outputs(packed: list[tuple]) -> list[CoreOutput]:
    make = CoreOutput._make
    return [make(t) for t in packed]
