"""Every Lua script of tokenrelay, each with its contract (KEYS, ARGV, reply) in the comment
above it, and the means to send them: the one home of Redis scripting for every side.

Why scripts at all: XADD, XACK and XCLAIM take no "expected owner", so every read-modify step
that depends on *who* holds an entry or owns a job (or, for producers, on whether a job id was
seen) runs inside one script, atomically.

- ``lua``: ``LuaScript`` and the one templating style (``string.Template`` over the contract's
  field names and separators: no field name is written by hand in Lua);
- ``resp``: ``pack``, the one RESP packer of both sides, and ``text``;
- ``pipeline``: ``ScriptPipeline`` (one round trip per node, NOSCRIPT-safe) and ``run_script``;
- ``enqueue``: the producers' enqueue (``ENQUEUE``);
- ``pending``: the worker's pending-list steps (``READ_NEW``, ``READ_OWN_PENDING``, ``RECLAIM``,
  ``MOVE_MINE``, ``ACK``, ``DROP_CONSUMER``);
- ``results``: fenced result writes and identity (``WRITE_STEP``, ``BIND_AND_OWN``,
  ``RELEASE_OWNER``, ``DEAD_LETTER``, ``REPLAY``);
- ``affinity``: the sweep of affinity streams (``MOVE_UNREAD``);
- ``worker_id``: the worker id lease (``ID_CLAIM``, ``ID_RELEASE``);
- ``cancel``: cancel by id, only for a job whose records exist (``CANCEL_KNOWN``);
- ``readers``: a reader letting go of a lost job's stale dedupe record (``FORGET_STALE_RECORD``);
- ``budget``: the recount of a shard's token budget counter (``RECOUNT_BUDGET``);
- ``streams``: the gateway's resumable SSE streams (``CLAIM_STREAM``, ``PARK_STREAM``,
  ``EXPIRE_PARKED``, ``END_STREAM``), one resume record each.

Every script's keys share one hash slot (one queue shard's tag, see ``Keys``; the stream
scripts touch their one record), as a Redis Cluster requires.
"""

from tokenrelay.protocol.scripts.affinity import MOVE_UNREAD
from tokenrelay.protocol.scripts.budget import RECOUNT_BUDGET
from tokenrelay.protocol.scripts.cancel import CANCEL_KNOWN, CancelTarget, cancel_target
from tokenrelay.protocol.scripts.enqueue import ENQUEUE
from tokenrelay.protocol.scripts.lua import CONTRACT_NAMES, LuaScript, lua
from tokenrelay.protocol.scripts.pending import (ACK, DROP_CONSUMER, MOVE_MINE, READ_NEW, READ_OWN_PENDING,
                                      RECLAIM)
from tokenrelay.protocol.scripts.pipeline import ScriptPipeline, run_script
from tokenrelay.protocol.scripts.readers import FORGET_STALE_RECORD
from tokenrelay.protocol.scripts.resp import pack, text
from tokenrelay.protocol.scripts.results import (BIND_AND_OWN, DEAD_LETTER, RELEASE_OWNER, REPLAY,
                                      WRITE_STEP)
from tokenrelay.protocol.scripts.streams import CLAIM_STREAM, END_STREAM, EXPIRE_PARKED, PARK_STREAM
from tokenrelay.protocol.scripts.worker_id import ID_CLAIM, ID_RELEASE

ALL_SCRIPTS: tuple[LuaScript, ...] = (
    ENQUEUE, READ_NEW, READ_OWN_PENDING, RECLAIM, MOVE_MINE, ACK, WRITE_STEP, BIND_AND_OWN,
    RELEASE_OWNER, DEAD_LETTER, REPLAY, MOVE_UNREAD, ID_CLAIM, ID_RELEASE, FORGET_STALE_RECORD,
    CANCEL_KNOWN, DROP_CONSUMER, RECOUNT_BUDGET, CLAIM_STREAM, PARK_STREAM, EXPIRE_PARKED,
    END_STREAM)

__all__ = ["ACK", "ALL_SCRIPTS", "BIND_AND_OWN", "CANCEL_KNOWN", "CancelTarget", "cancel_target",
           "CLAIM_STREAM", "CONTRACT_NAMES", "END_STREAM", "EXPIRE_PARKED", "PARK_STREAM", "DROP_CONSUMER", "DEAD_LETTER", "ENQUEUE",
           "FORGET_STALE_RECORD",
           "ID_CLAIM", "ID_RELEASE", "LuaScript", "MOVE_MINE", "MOVE_UNREAD", "READ_NEW",
           "READ_OWN_PENDING", "RECLAIM", "RECOUNT_BUDGET", "RELEASE_OWNER", "REPLAY",
           "ScriptPipeline", "WRITE_STEP", "lua", "pack", "run_script", "text"]
