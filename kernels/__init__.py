"""Triton kernels for the paged engine, each beside a plain-torch reference (tensors in, tensors out)."""
