"""Redis fixtures (filled in by the worker work)."""
