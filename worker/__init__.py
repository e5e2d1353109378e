"""The tokenrelay worker: Redis Streams in, engine steps, result streams out. Run with ``python -m worker``."""
