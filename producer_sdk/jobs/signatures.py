"""The one written form of ``submit()``'s signature and docstring, shared by both clients.

``submit`` takes a long list of job fields plus every sampling field; writing it in ``Client``
and again in ``AsyncClient`` let the two drift. Here it is written once (``submit`` below:
never called, it only declares) and ``same_signature`` gives it to each client's method: at run
time as ``__signature__`` and ``__doc__`` (what ``help()`` and ``inspect`` show), and to type
checkers through its ``ParamSpec`` (what IDEs complete). ``tests/sdk/test_signatures.py`` checks
the job fields against the models they come from (``protocol.wire.JobRequest``; the sampling
fields are ``protocol.sampling_params.SamplingParams``'s, listed in the docstring from it).
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable, Optional, ParamSpec, TypeVar

from tokenrelay.protocol.sampling_params import SamplingParams

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)

# submit()'s own options, about sending rather than the job (the rest are job fields)
SEND_OPTIONS = ("block", "block_timeout", "durable")


def submit(self, prompt: Optional[str] = None, *,
           messages: Optional[list[dict[str, Any]]] = None,
           prompt_token_ids: Optional[list[int]] = None, job_id: Optional[str] = None,
           priority: int = 0, deadline_s: Optional[float] = None, stream: bool = True,
           metadata: Optional[dict[str, Any]] = None,
           chat_template_kwargs: Optional[dict[str, Any]] = None,
           tools: Optional[list[dict[str, Any]]] = None,
           traceparent: Optional[str] = None, routing_key: Optional[str] = None,
           model: Optional[str] = None, producer: Optional[str] = None,
           queue: Optional[str] = None, block: bool = False,
           block_timeout: Optional[float] = None, durable: Optional[bool] = None,
           **sampling: Any) -> Any:
    """Enqueue one job. Sampling fields are validated first (ValueError names a bad one).

    Raises QueueFull past the queue's high-water mark unless ``block`` (then waits up to
    ``block_timeout`` seconds), RedisUnavailable when Redis cannot be reached. Submitting a
    ``job_id`` that is already known returns a handle on the existing job.
    ``chat_template_kwargs`` (with ``messages``) are variables for the model's chat
    template, e.g. ``{"enable_thinking": False}`` for Qwen3; ``tools`` (with ``messages``)
    are OpenAI's function tools, rendered by the template (a worker whose template ignores
    tools refuses them). ``structured_outputs`` (a sampling field: ``{"json": schema}``,
    ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": True}``
    or a ``StructuredOutputsParams``) constrains the answer so it parses; a bad schema raises
    InvalidRequest before anything is sent. ``traceparent`` (W3C Trace
    Context) is carried with the job and logged by the worker with every line of it.
    ``routing_key`` (a conversation or system-prompt id, OpenAI's ``prompt_cache_key``)
    sends jobs with the same key to the same live worker, whose prefix cache holds what
    they share (producer_sdk/core/affinity.py); without it the job goes to the shared lanes.
    ``model`` (a served model's name, the gateway's and the batch runner's ``model``) sends
    the job to the queue live workers serve that model on (ModelNotFound, nothing sent, when
    none does); the job carries it, and a worker of another model refuses the job rather than
    answer it. ``producer`` (default: the client's ``producer``) names who submits the job:
    workers share their grammar compile threads fairly among producers, so one producer's
    backlog of slow constraints does not delay another's. ``queue`` sends the job to another queue of the client's namespace (with
    ``model`` too: that queue, the model still checked by the worker).
    ``durable`` (default: the client's ``durable``) waits until ``durable_replicas``
    replicas acknowledged the enqueue, else raises NotDurable with the job enqueued.
    """


def _sampling_doc() -> str:
    text = (f"Sampling fields (``**sampling``, ``SamplingParams``, vLLM's names): "
            f"{', '.join(SamplingParams.model_fields)}. Unset ones are left to the worker; an "
            f"unknown name raises InvalidRequest.")
    return textwrap.indent(textwrap.fill(text, 92), "    ") + "\n"


submit.__doc__ = (submit.__doc__ or "").rstrip() + "\n" + _sampling_doc()
SUBMIT = inspect.signature(submit)


# Every named parameter after ``prompt`` is keyword-only with a default, so binding a call is
# merging its keywords over these (with ``**sampling`` flattened in): a dict merge, not
# ``Signature.bind`` (which costs more than the rest of building a payload).
_DEFAULTS = {name: p.default for name, p in SUBMIT.parameters.items()
             if p.default is not inspect.Parameter.empty}


def bind_submit(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``submit(*args, **kwargs)`` call as the template's arguments, defaults applied and
    ``**sampling`` flattened in (a TypeError, as Python's own, for a call that does not fit)."""
    out = {**_DEFAULTS, **kwargs}
    if args:
        if len(args) > 1:
            raise TypeError(f"submit() takes 1 positional argument (prompt) but {len(args)} "
                            f"were given")
        if "prompt" in kwargs:
            raise TypeError("submit() got multiple values for argument 'prompt'")
        out["prompt"] = args[0]
    return out


def same_signature(template: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated method ``template``'s parameters and docstring (keeping its own
    return annotation): for ``help()`` and ``inspect`` at run time, and for type checkers,
    which read the parameters from ``P``."""
    def apply(method: Callable[..., R]) -> Callable[P, R]:
        own = inspect.signature(method).return_annotation
        method.__signature__ = inspect.signature(template).replace(  # type: ignore[attr-defined]
            return_annotation=own)
        method.__doc__ = template.__doc__
        return method  # type: ignore[return-value]
    return apply


def docs_from(source: type) -> Callable[[C], C]:
    """Class decorator: each public method without a docstring takes the one of ``source``'s
    method of the same name (the async client's methods mean what the sync client's do)."""
    def apply(cls: C) -> C:
        for name, member in vars(cls).items():
            original = getattr(source, name, None)
            if (not name.startswith("_") and inspect.isfunction(member) and not member.__doc__
                    and original is not None and original.__doc__):
                member.__doc__ = original.__doc__
        return cls
    return apply


__all__ = ["submit", "SUBMIT", "SEND_OPTIONS", "bind_submit", "same_signature", "docs_from"]
