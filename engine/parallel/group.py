"""One rank's handle on its tensor-parallel group: the collectives the model and the step need.

Two torch.distributed process groups are built directly on the engine's own rendezvous store
(never the process-wide default group, so several engines, and several workers on one host,
each have their own):

- the *device* group (NCCL on CUDA, gloo on CPU) carries the forward's all-reduces and the
  logits gather, with the engine's collective timeout;
- the *control* group (always gloo, on host tensors) carries the prepared step from rank 0. A
  rank waits on it for the next step for as long as the engine sits idle, so its timeout is
  effectively infinite (rank 0's sends still give up after the engine's timeout); a rank 0
  that dies closes the connection, which ends the wait at once.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# A rank may wait this long for rank 0's next step (an idle engine sends none).
_IDLE_WAIT = datetime.timedelta(days=365)
# Starting an interpreter, importing torch and loading a share of the weights may take a while
# on a busy host: start-up waits at least this long, whatever the collectives' timeout.
START_TIMEOUT_S = 120.0


def start_timeout(timeout_s: float) -> float:
    """How long ranks get to start, check in and agree on the KV pool."""
    return max(timeout_s, START_TIMEOUT_S)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet: rank 0's TCPStore, on a port the OS chose."""

    host: str
    port: int
    timeout_s: float


def rank_devices(device: str, size: int) -> list[str]:
    """The device of each rank: all "cpu" on CPU; on CUDA consecutive devices from the one
    named (``cuda`` or ``cuda:0`` -> ``cuda:0 .. cuda:N-1``; ``cuda:2`` -> ``cuda:2 ..``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [str(dev)] * size
    first = dev.index or 0
    visible = torch.cuda.device_count()
    if first + size > visible:
        raise ValueError(f"tensor_parallel_size={size} from {device} needs cuda:{first} .. "
                         f"cuda:{first + size - 1}, but {visible} CUDA device(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES picks which)")
    return [f"cuda:{first + r}" for r in range(size)]


def open_store(rendezvous: Optional[Rendezvous], size: int, timeout_s: float
               ) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0 (``rendezvous`` None): a new store on a free port; other ranks: a client of it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rendezvous is None:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout,
                              wait_for_workers=False)
        return store, Rendezvous("127.0.0.1", store.port, timeout_s)
    store = dist.TCPStore(rendezvous.host, rendezvous.port, size, False, timeout=timeout)
    return store, rendezvous


def _gloo(store: dist.Store, prefix: str, rank: int, size: int,
          timeout: datetime.timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def _nccl(store: dist.Store, rank: int, size: int,
          timeout: datetime.timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, options)


class ParallelGroup:
    """Rank ``rank`` of ``size``: all-reduce, the logits gather, the step broadcast."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.device = rank, size, device
        self.store = store          # kept: the groups' connections were made through it
        self.timeout_s = timeout_s
        self.control = _gloo(store, "control", rank, size, _IDLE_WAIT)
        if device.type == "cuda":
            self.devices = _nccl(store, rank, size, timeout)
        else:
            self.devices = _gloo(store, "device", rank, size, timeout)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.devices.allreduce([x]).wait()
        return x

    def min_int(self, value: int) -> int:
        """The minimum of ``value`` over the ranks (start-up agreements, e.g. the KV pool),
        waiting at most :func:`start_timeout` for the slowest rank to load."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        wait = datetime.timedelta(seconds=start_timeout(self.timeout_s))
        self.control.allreduce([t], opts).wait(wait)
        return int(t.item())

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        """Rank 0: every rank's ``[N, vocab_per_rank]`` logits side by side, padding cut off
        (``[N, vocab_size]``); other ranks: None."""
        local = local.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.devices.gather([], [local], opts).wait()
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.devices.gather([parts], [local], opts).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's host tensor ``t`` into every rank's ``t`` (same shape and dtype). Rank 0
        gives up after the timeout (a rank that stopped reading is hung); the others wait for
        as long as rank 0 lets them."""
        work = self.control.broadcast(t, 0)
        if self.rank == 0:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        else:
            work.wait()
        return t
