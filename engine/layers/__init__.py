"""How a forward pass computes: the layers and ops the decoder (engine/models/) is built from.

What a step decides (which sequences run, their blocks, the sampled tokens: the scheduler,
block manager, sequences, sampler and ModelRunner in engine/) hands this package tensors and
reads logits back; nothing here imports that side (tests/engine/test_import_graph.py holds it).

- ``ops.py``: the seven ops the decoder calls, chosen by backend (torch, compiled torch, or the
  Triton kernels of ``tokenrelay.kernels``);
- ``torch_ops.py``: the plain-torch norm, activation and RoPE ops, with the kernels' signatures;
- ``attention.py``: paged attention in torch, and the metadata every layer reads;
  ``attention_plan.py``: how a step's batch splits for it, planned once per step;
- ``compiled.py``: torch.compile with a fallback; ``compiled_decode.py`` and ``compiled_rope.py``:
  the CPU float32 kernels it compiles;
- ``linear.py``: the linear layer, with ``cpu_gemm.py``'s pre-packed CPU GEMM;
- ``tensor_parallel.py``: the layer factories the decoder builds its projections, embedding
  and LM head from (plain layers at one rank, split ones over engine/parallel/'s group);
- ``cuda_graphs.py``: decode steps captured and replayed as CUDA graphs.
"""
