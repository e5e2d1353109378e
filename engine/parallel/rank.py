"""Ranks 1..N-1 of a tensor-parallel engine: ``python -m tokenrelay.engine.parallel.rank``, one small loop.

Started by engine/parallel/launch.py: read the pickled :class:`RankSpec` (rank_spec.py) from
stdin and keep watching stdin (the lifeline: end of file means rank 0's process is gone), check
in to the rendezvous store, join the process groups, load this rank's share of the model and its
KV cache (engine/model_runner.py, the same class rank 0 runs), then serve: receive the prepared
step, run the forward (joining its all-reduces and the logits gather), repeat until told to
stop (the lifeline). There is no scheduler, sampler or tokenizer here; those live on rank 0.

A rank ignores SIGINT and SIGTERM: a Ctrl-C or a ``kill`` of the process group is for rank 0
to handle (the worker drains on SIGTERM), and the rank ends with it through the lifeline.
Any error ends the rank with one line on stderr and exit code 1; rank 0 notices its exit.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, NoReturn

import torch

from tokenrelay.engine.lifeline import child_start, watch_lifeline
from tokenrelay.engine.parallel.group import ParallelGroup, open_store
from tokenrelay.engine.parallel.rank_spec import RankSpec, hello_key


def serve(runner: Any, group: ParallelGroup) -> NoReturn:
    """Run rank 0's steps, for as long as rank 0 lives (the lifeline ends the process)."""
    from tokenrelay.engine.parallel.step import receive_step
    while True:
        runner.run(receive_step(group))


def rank_main(spec: RankSpec, lifeline: Any) -> NoReturn:
    """A rank's life, from its spec to the end of rank 0's process."""
    parent = os.getppid()
    watch_lifeline(lifeline, "tp-lifeline")
    config = spec.config
    size = config.tensor_parallel_size
    try:
        torch.set_num_threads(spec.threads)
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store, _ = open_store(spec.rendezvous, size, spec.rendezvous.timeout_s)
        store.set(hello_key(spec.rank), str(os.getpid()))
        group = ParallelGroup(store, spec.rank, size, device, config.tensor_parallel_timeout)
        from tokenrelay.engine.model_runner import ModelRunner
        runner = ModelRunner(config, group=group)
        serve(runner, group)
    except BaseException as exc:     # one line, then the details, then exit 1
        if os.getppid() != parent:   # rank 0's process died first: its connections dropped
            os._exit(0)
        print(f"tokenrelay tensor-parallel rank {spec.rank} (pid {os.getpid()}) failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    spec, lifeline = child_start()
    rank_main(spec, lifeline)


if __name__ == "__main__":
    main()
