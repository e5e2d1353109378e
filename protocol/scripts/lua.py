"""A Lua script as the contract names it: its source, with the contract's field names and
separators substituted in, and its SHA1 (what EVALSHA sends).

One templating style for every script: ``string.Template``. A script writes ``$event``,
``$batch``, ``$payload``, ``$cost``, ``$sep`` or ``$instance`` where the contract's name goes,
and ``lua`` substitutes the values of ``protocol.keys`` and ``protocol.heartbeat`` once, at
import; a ``$name`` the contract does not define fails the import (``Template.substitute`` is
strict). So no field name is written by hand in Lua: renaming one in the contract renames it in
every script.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from string import Template

from tokenrelay.protocol.heartbeat import INSTANCE_FIELD
from tokenrelay.protocol.keys import BATCH_FIELD, COST_FIELD, DEDUPE_SEPARATOR, EVENT_FIELD, PAYLOAD_FIELD

# What a script's ``$name`` stands for.
CONTRACT_NAMES: dict[str, str] = {
    "event": EVENT_FIELD.decode(),        # a result stream entry's event field
    "batch": BATCH_FIELD.decode(),        # a result stream entry's write-batch mark
    "payload": PAYLOAD_FIELD.decode(),    # a job stream entry's payload field
    "cost": COST_FIELD.decode(),          # a job stream entry's admitted token cost
    "sep": DEDUPE_SEPARATOR,              # between lane key and entry id in a dedupe record
    "instance": INSTANCE_FIELD,           # the heartbeat field naming the id lease's holder
}


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str                                       # what Redis runs
    template: str = field(default="", repr=False)     # as written, before substitution
    sha: str = field(init=False, repr=False)          # what EVALSHA names (once, not per call)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def lua(name: str, template: str) -> LuaScript:
    """The script ``name`` with the contract's names substituted into ``template``."""
    return LuaScript(name, Template(template).substitute(CONTRACT_NAMES), template)
