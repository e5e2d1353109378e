"""Sending scripts: one round trip per node, and never a lost call to a flushed script cache.

``ScriptPipeline`` queues script calls (and plain commands), packs each with ``resp.pack`` and
sends them with ``topology.send_packed``; ``run_script`` is one call now. Either side may use
them: the worker for every step, the admin command for a replay.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import redis

from tokenrelay.protocol.scripts.lua import LuaScript
from tokenrelay.protocol.scripts.resp import pack
from tokenrelay.protocol.topology import send_packed


class ScriptPipeline:
    """A non-transactional pipeline whose script calls survive a script-cache flush, sent to
    the node of each command's keys.

    Every command is packed here and sent with ``topology.send_packed``: grouped by the Redis
    Cluster node that serves its routing key (a script's first key, a command's first argument
    after its name), every node's commands written before any reply is read, so a batch costs
    one round trip per node however many jobs it carries (one round trip on a single Redis).
    redis-py's pipeline machinery is not used: it cost more than Redis's own work for a step.
    ``execute`` returns one raw RESP2 reply per command (no redis-py response callbacks), error
    replies in place (never raised), except connection errors, which propagate: the caller
    reconnects and retries the whole batch, which is safe because every write of the scripts
    is idempotent (batch ids, XPENDING-checked acks). Scripts go as EVALSHA; a NOSCRIPT reply
    (Redis restarted, a failover to a replica that never saw the script, a flushed cache) is
    retried with EVAL for that command only, on its node, so a call costs one round trip, not a
    SCRIPT EXISTS round trip more as redis-py's pipelined ``Script`` objects do.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cmds: list[tuple[Optional[LuaScript], tuple[Any, ...], Any]] = []

    def __len__(self) -> int:
        return len(self._cmds)

    def command(self, *args: Any, key: Any = None) -> int:
        """Queue a plain command; routed by ``key`` (default: its first argument)."""
        self._cmds.append((None, args, key if key is not None else
                           (args[1] if len(args) > 1 else None)))
        return len(self._cmds) - 1

    def script(self, script: LuaScript, keys: Sequence[Any], args: Sequence[Any]) -> int:
        """Queue a script call; all its keys must share a slot (routed by the first)."""
        self._cmds.append((script, (len(keys), *keys, *args), keys[0] if keys else None))
        return len(self._cmds) - 1

    def execute(self) -> list[Any]:
        if not self._cmds:
            return []
        results = send_packed(self._client, [
            (key, pack(("EVALSHA", script.sha, *args) if script is not None else args), 1)
            for script, args, key in self._cmds])
        missing = [i for i, r in enumerate(results)
                   if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            again = send_packed(self._client, [
                (self._cmds[i][2], pack(("EVAL", self._cmds[i][0].source, *self._cmds[i][1])), 1)
                for i in missing])
            for i, r in zip(missing, again):
                results[i] = r
        return results


def run_script(client: Any, script: LuaScript, keys: Sequence[Any],
               args: Sequence[Any]) -> Any:
    """One script call now (NOSCRIPT-safe); an error reply is raised."""
    pipe = ScriptPipeline(client)
    pipe.script(script, keys, args)
    (reply,) = pipe.execute()
    if isinstance(reply, Exception):
        raise reply
    return reply
