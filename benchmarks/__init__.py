"""Benchmark programs, run as ``python -m benchmarks.<name>``: they print measured figures.

They live apart from the runtime packages (engine, kernels, worker, producer_sdk, protocol) and are
not installed with them; run them from a checkout.
"""
