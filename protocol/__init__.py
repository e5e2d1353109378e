"""The tokenrelay contract: everything the engine, the worker and the producer SDK must agree on.

One home for each concept that crosses a process boundary:

- ``keys``: every Redis key and stream field name (shard hash tags included);
- ``wire``: the job payload, its one validation, dead letters, result events off the wire;
- ``errors``: error codes, finish reasons, ``ProtocolError``;
- ``events`` and ``fold``: the result stream's events and the one way to fold them;
- ``limits``, ``sampling_params``, ``logprobs``: what a job may ask for;
- ``shards``: the queue's registered shard count;
- ``topology``: making Redis clients (plain or cluster) and packed per-node sends;
- ``settings``: the settings -> command-line layer every command shares, with its defaults;
- ``heartbeat``: the worker heartbeat hash, written by workers, read by everyone else;
- ``scripts``: every Lua script, each with its KEYS/ARGV contract.

It imports nothing of ``engine``, ``worker`` or ``producer_sdk``, and no torch or FastAPI
(tests/protocol/test_boundaries.py): the engine and the SDK stand side by side on it.
"""

if not __name__.startswith("tokenrelay."):   # the bare folder, imported from the repository root
    raise ImportError(f"import tokenrelay.{__name__} (commands: `tokenrelay ...`), not {__name__!r}: "
                      "our packages live under the tokenrelay namespace")
