"""What every tokenrelay command line shares: one settings -> command-line layer, the connection
settings, and how a command ends when its reader goes away (``... | head``).

Used by ``tokenrelay worker`` (and its ``health`` and ``admin`` subcommands) and by
``tokenrelay``. Each command's options are a pydantic-settings model; its flags are
generated from the model's fields, so a flag, its environment variable and its default cannot
drift apart: field ``foo_bar`` is ``--foo-bar`` and ``TOKENRELAY_FOO_BAR``. Flags win over
environment variables, environment variables over defaults. Flags default to SUPPRESS, so a
flag not given never hides the environment, and a command's flags may be given before or after
its subcommand (the value nearest the end wins). Positional arguments (job ids, file paths) are
plain argparse arguments, not settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
import warnings
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenrelay.protocol.keys import MAX_SHARDS

EXIT_SIGPIPE = 141      # what a shell reports for a process ended by SIGPIPE (128 + 13)
EXIT_USAGE = 2          # argparse's exit code for a bad command line
ENV_PREFIX = "TOKENRELAY_"
_MODEL = "_settings_model"      # namespace key: the settings model of the (sub)command chosen
_SETTING = "setting:"           # namespace key prefix of a setting's flag (never a positional's)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "TOKENRELAY_REDIS_URL"
CLUSTER_ENV = "TOKENRELAY_CLUSTER"
SHARDS_ENV = "TOKENRELAY_SHARDS"


def default_redis_url() -> str:
    """``$TOKENRELAY_REDIS_URL`` or the local default; read at call time so tests can set it."""
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def default_cluster() -> Optional[str]:
    """``$TOKENRELAY_CLUSTER`` (auto/on/off), the command lines' variable; unset: auto."""
    return os.environ.get(CLUSTER_ENV) or None


def default_shards() -> Optional[str]:
    """``$TOKENRELAY_SHARDS``; unset: the queue's registered count."""
    return os.environ.get(SHARDS_ENV) or None


def run_cli(main: Callable[[], int]) -> int:
    """Run a CLI's ``main``; when the reader of stdout closed it early, end quietly with 141
    instead of a BrokenPipeError traceback (the way ``cat`` or ``grep`` end under ``head``)."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python flushes stdout once more at exit: point it at /dev/null so that cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_SIGPIPE


# --------------------------------------------------------------------------------------------
# settings models
# --------------------------------------------------------------------------------------------

class CliSettings(BaseSettings):
    """Base of every command's settings: read from ``TOKENRELAY_<NAME>`` below the flags."""

    # An empty variable is an unset one, as ``${VAR:-default}`` reads it in compose: a .env line
    # ``TOKENRELAY_MAX_MODEL_LEN=`` keeps the default instead of failing to parse "".
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore",
                                      validate_default=True, env_ignore_empty=True)


def own_env(command: str, name: str) -> dict[str, Any]:
    """``Field`` keywords for a setting whose meaning is its command's own (``priority``:
    submit's 0, batch's 1): its variable is ``TOKENRELAY_<COMMAND>_<NAME>``, so setting one
    command's never changes another's. Settings every command means the same way (the
    connection, back-pressure, durable ones) keep ``TOKENRELAY_<NAME>``."""
    return {"validation_alias": f"{ENV_PREFIX}{command.upper()}_{name.upper()}"}


def unset(meaning: str) -> dict[str, Any]:
    """``json_schema_extra`` for a field whose default is None: what None means, for --help
    (``Field(None, json_schema_extra=unset("every queue"))``); --help never says "None"."""
    return {"unset": meaning}


def key_part(value: Optional[str]) -> Optional[str]:
    """A namespace or queue name is one segment of a Redis key: braces (hash tags), colons
    (separators) and whitespace would make keys other components cannot find."""
    if value is not None and (not value or any(c in value for c in "{}: \t\n")):
        raise ValueError("must be non-empty without braces, colons or whitespace")
    return value


class ConnectionSettings(CliSettings):
    """Where a command finds its queue: shared by the worker, its admin and health commands and
    the producer CLI, so ``TOKENRELAY_NAMESPACE`` (and the others) mean the same everywhere."""

    redis_url: str = Field(DEFAULT_REDIS_URL,
                           description="redis:// or rediss:// URL; user:password@ works.")
    namespace: str = Field("tokenrelay", description="Key prefix shared by producers and workers.")
    queue: str = Field("default", description="Queue name (jobs streams <ns>:jobs:{<queue>...}).")
    cluster: Literal["auto", "on", "off"] = Field(
        "auto", description="Redis Cluster mode: auto asks the server at --redis-url (any node "
                            "of a cluster will do); on/off force it.")
    shards: Optional[int] = Field(
        None, ge=1, le=MAX_SHARDS,
        description="How many streams (each in its own cluster slot) the queue is split into.",
        json_schema_extra=unset("the count registered in <ns>:config:<queue> by the queue's "
                                "first worker or producer; none yet: a producer registers 1 "
                                "before it enqueues, a worker 1 before it reads"))

    _key_parts = field_validator("namespace", "queue")(key_part)


class BackPressureSettings(CliSettings):
    """A producer's own bounds for the queues it sends to, over the queue's shared ones (the
    ``max_queued_jobs`` / ``max_queued_tokens`` fields of ``<ns>:config:<queue>``): the CLI's
    submit and batch commands and the gateway take the same flags and variables."""

    max_queued_jobs: Optional[int] = Field(
        None, ge=0, description="Refuse (or, blocking, wait) past this many jobs queued or "
        "running in the queue; 0: no bound.",
        json_schema_extra=unset("the queue's max_queued_jobs in <ns>:config:<queue>, else "
                                "100000"))
    max_queued_tokens: Optional[int] = Field(
        None, ge=0, description="Token budget: refuse (or wait) past this many tokens (prompt "
        "+ max_tokens of each job) queued or running; split evenly over the shards; 0: none.",
        json_schema_extra=unset("the queue's max_queued_tokens in <ns>:config:<queue>, else "
                                "none"))


with warnings.catch_warnings():
    # The field shadows BaseModel.json, pydantic v1's deprecated serializer (never called here);
    # the flag has always been --json, and renaming the field would rename the flag.
    warnings.filterwarnings("ignore", message='Field name "json"', category=UserWarning)

    class JsonOutput(CliSettings):
        """The ``--json`` switch of the commands that print rows or records."""

        json: bool = Field(False, description="Print JSON (machine-readable) instead of text.")


# --------------------------------------------------------------------------------------------
# models -> flags
# --------------------------------------------------------------------------------------------

def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str, model: Optional[type[BaseSettings]] = None) -> str:
    """The environment variable of setting ``name`` (of ``model``: its own, ``own_env``)."""
    field = model.model_fields.get(name) if model is not None else None
    return (_alias(field) if field is not None else None) or ENV_PREFIX + name.upper()


def _base_type(annotation: Any) -> Any:
    """``Optional[X]`` -> ``X``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _default_text(name: str, field: FieldInfo) -> str:
    """The default as --help shows it; a None default must say what unset means."""
    if field.default is not None:
        return str(field.default)
    extra = field.json_schema_extra
    if not isinstance(extra, dict) or "unset" not in extra:
        raise TypeError(f"setting {name!r} defaults to None: give it "
                        f"json_schema_extra=unset('what no value means') for --help")
    return str(extra["unset"])


def add_settings_flags(parser: argparse.ArgumentParser, model: type[CliSettings]) -> None:
    """One flag per field of ``model``, and ``model`` recorded as the parser's settings (the
    innermost subcommand's recording wins). Defaults are SUPPRESSed: an absent flag leaves the
    field to its environment variable, then its default."""
    parser.set_defaults(**{_MODEL: model})
    for name, field in model.model_fields.items():
        help_text = (f"{field.description or ''} "
                     f"[env {env_of(name, model)}; default: {_default_text(name, field)}]")
        base = _base_type(field.annotation)
        kwargs: dict[str, Any] = {"dest": _SETTING + name, "default": argparse.SUPPRESS,
                                  "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is list:
            kwargs.update(action="append", metavar=name.upper(),
                          help=help_text + " (repeatable; env: a JSON list)")
        else:
            kwargs["metavar"] = name.upper()
        parser.add_argument(flag_of(name), **kwargs)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, by field name."""
    return {k[len(_SETTING):]: v for k, v in vars(args).items() if k.startswith(_SETTING)}


def settings_from_args(args: argparse.Namespace) -> CliSettings:
    """The chosen command's settings: flags over env vars over defaults (pydantic-settings gives
    init kwargs precedence). Raises pydantic's ValidationError for a bad value."""
    model: type[CliSettings] = getattr(args, _MODEL)
    fields = model.model_fields     # a setting with its own variable is given by that name
    return model(**{_alias(fields[k]) or k: v for k, v in given_settings(args).items()
                    if k in fields})


def _alias(field: FieldInfo) -> Optional[str]:
    return field.validation_alias if isinstance(field.validation_alias, str) else None


def describe_settings_error(exc: ValidationError,
                            model: Optional[type[BaseSettings]] = None) -> str:
    """One line per bad setting, named as the user typed it (flag and environment variable)."""
    by_alias = {_alias(f): n for n, f in (model.model_fields if model else {}).items()}
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else "settings"
        name = by_alias.get(name, name)
        lines.append(f"{flag_of(name)} / {env_of(name, model)}: {err['msg']} "
                     f"(got {err.get('input')!r:.60})")
    return "; ".join(lines)


def parse_settings(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
                   ) -> tuple[argparse.Namespace, CliSettings]:
    """Parse ``argv`` and build the chosen (sub)command's settings. A bad value, or a flag of
    another command (``tokenrelay worker --max-num-seqs 3 health``), ends with usage and exit 2."""
    args = parser.parse_args(argv)
    model: type[CliSettings] = getattr(args, _MODEL)
    stray = sorted(set(given_settings(args)) - set(model.model_fields))
    if stray:
        parser.error(f"{', '.join(map(flag_of, stray))} does not apply to this command")
    try:
        return args, settings_from_args(args)
    except ValidationError as exc:
        parser.error(describe_settings_error(exc, model))
