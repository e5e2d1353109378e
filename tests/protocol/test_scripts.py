"""protocol/scripts: every Lua script in one home, written against the contract's names, each
with its contract in its header comment; one RESP packer for both sides; the NOSCRIPT-safe
pipeline."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
import redis
from redis.connection import Connection

import tokenrelay.protocol.scripts as scripts
from tokenrelay.protocol.scripts import (ALL_SCRIPTS, CONTRACT_NAMES, LuaScript, ScriptPipeline, lua, pack,
                              run_script)
from tests.import_boundaries import ROOT, package_files

pytestmark = pytest.mark.timeout(60)


def script_modules() -> list:
    return [importlib.import_module(f"tokenrelay.protocol.scripts.{m.name}")
            for m in pkgutil.iter_modules(scripts.__path__)]


def test_every_script_of_the_package_is_listed_once():
    defined = {id(v): v for m in script_modules() for v in vars(m).values()
               if isinstance(v, LuaScript)}
    assert sorted(s.name for s in defined.values()) == sorted(s.name for s in ALL_SCRIPTS)
    assert len({s.name for s in ALL_SCRIPTS}) == len(ALL_SCRIPTS)
    assert len({s.sha for s in ALL_SCRIPTS}) == len(ALL_SCRIPTS)


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda s: s.name)
def test_scripts_name_contract_fields_only_through_the_template(script):
    """No field name or separator written by hand: each is ``$name`` in the template, the
    contract's value in the source."""
    for value in CONTRACT_NAMES.values():
        assert f"'{value}'" not in script.template, f"{script.name} writes {value!r} by hand"
    assert "$" not in script.source
    used = {name for name in CONTRACT_NAMES if f"${name}" in script.template}
    for name in used:
        assert f"'{CONTRACT_NAMES[name]}'" in script.source


def test_each_script_states_its_contract_in_the_comment_above_it():
    for module in script_modules():
        lines = Path(module.__file__).read_text().splitlines()
        for i, line in enumerate(lines):
            if " = lua(" not in line:
                continue
            k = i
            while k > 0 and lines[k - 1].startswith("#"):
                k -= 1
            header = " ".join(lines[k:i])
            name = line.split(" = ")[0]
            assert "KEYS" in header and "ARGV" in header, f"{name}: no KEYS/ARGV contract"


def test_a_contract_name_the_template_does_not_know_fails_at_once():
    with pytest.raises(KeyError):
        lua("bad", "return redis.call('GET', '$nosuchfield')")
    assert lua("ok", "return '$payload'").source == "return 'data'"


def test_no_lua_outside_the_scripts_package():
    """Every ``redis.call`` of the repository's runtime packages is in protocol/scripts."""
    found = []
    for package in ("protocol", "worker", "producer_sdk", "engine"):
        for path in package_files(package):
            if "scripts" in path.relative_to(ROOT).parts[:2]:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                        "redis.call(" in node.value or "redis.pcall(" in node.value):
                    found.append(str(path.relative_to(ROOT)))
    assert found == []


# ------------------------------------------------------------------------------------------
# RESP
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("PING",),
    ("EVALSHA", "a" * 40, 2, "k1", b"k2", 0, -17, 3.25, "h\u00e9llo", b"\x00\xff\r\n", ""),
    (b"XLEN", b"tokenrelay:jobs:{q}"),
    ("SET", "k", 10**20, "EX", 60),
])
def test_pack_writes_what_redis_py_writes(args):
    assert pack(args) == b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize("bad", [True, None, object(), [1]])
def test_pack_refuses_what_is_no_redis_argument(bad):
    with pytest.raises(TypeError):
        pack(("SET", "k", bad))


# ------------------------------------------------------------------------------------------
# the pipeline
# ------------------------------------------------------------------------------------------

ECHO = lua("echo_test", "return {KEYS[1], ARGV[1]}")
FAIL = lua("fail_test", "return redis.error_reply('NOPE for ' .. KEYS[1])")


def calls(r, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_pipeline_survives_a_flushed_script_cache_and_keeps_errors_in_place(redis_server):
    r = redis_server.client()
    r.script_load(ECHO.source)
    r.script_flush()

    def batch() -> list:
        pipe = ScriptPipeline(r)
        pipe.script(ECHO, ["k"], ["v"])
        pipe.script(FAIL, ["k"], [])
        pipe.command("SET", "plain", "1")
        return pipe.execute()
    res = batch()
    assert res[0] == [b"k", b"v"] and res[2] in (b"OK", "OK")
    assert isinstance(res[1], redis.ResponseError) and "NOPE for k" in str(res[1])
    assert (calls(r, "evalsha"), calls(r, "eval")) == (2, 2)   # NOSCRIPT: each sent again once
    assert batch()[0] == [b"k", b"v"]
    assert (calls(r, "evalsha"), calls(r, "eval")) == (4, 2)   # cached by the EVAL since
    with pytest.raises(redis.ResponseError, match="NOPE"):
        run_script(r, FAIL, ["k"], [])
    assert run_script(r, ECHO, ["a"], [1]) == [b"a", b"1"]
    assert len(ScriptPipeline(r)) == 0 and ScriptPipeline(r).execute() == []
