"""Helpers for development programs: the demos, the benchmarks and the tests all import these,
and none is installed (pyproject.toml packages only the runtime folders), so nothing here may
be imported by ``tokenrelay.*``."""
