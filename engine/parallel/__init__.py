"""Tensor parallelism: one model split over several processes or devices (torch.distributed:
NCCL on CUDA, gloo on CPU).

- ``partition.py``: what each rank holds (query/KV heads, MLP columns, vocabulary rows) and
  which sizes a model allows;
- ``group.py``: a rank's process groups and the collectives (all-reduce, logits gather, the
  control channel);
- ``step.py``: the prepared step, from rank 0 to the others, as tensors;
- ``launch.py``: rank 0 starts, watches and stops the other ranks;
- ``rank.py``: the loop a spawned rank runs; ``rank_spec.py``: what rank 0 hands it.

The split layers the decoder builds on (and which slice of each checkpoint tensor a rank reads)
are the forward pass's: engine/layers/tensor_parallel.py. At ``tensor_parallel_size=1`` none of
this runs: the decoder gets its plain layers and the ModelRunner runs each step as it prepares
it.
"""
