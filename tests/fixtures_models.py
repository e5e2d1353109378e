"""Model fixtures (filled in by the engine work)."""
