"""Tensor parallelism: one model split over several processes or devices (torch.distributed:
NCCL on CUDA, gloo on CPU).

- ``partition.py``: what each rank holds (query/KV heads, MLP columns, vocabulary rows) and
  which sizes a model allows;
- ``group.py``: a rank's process groups and the collectives (all-reduce, logits gather, the
  control channel);
- ``layers.py``: the parallel-layer seam the decoder builds on, and which slice of each
  checkpoint tensor a rank reads;
- ``step.py``: the prepared step, from rank 0 to the others, as tensors;
- ``launch.py``: rank 0 starts, watches and stops the other ranks;
- ``rank.py``: the loop a spawned rank runs.

At ``tensor_parallel_size=1`` none of it runs: the decoder gets its plain layers and the
ModelRunner runs each step as it prepares it.
"""
