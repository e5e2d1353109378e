"""The tokenrelay worker: Redis Streams in, engine steps, result streams out. Run with ``tokenrelay worker``."""

if not __name__.startswith("tokenrelay."):   # the bare folder, imported from the repository root
    raise ImportError(f"import tokenrelay.{__name__} (commands: `tokenrelay ...`), not {__name__!r}: "
                      "our packages live under the tokenrelay namespace")
