"""Benchmark: what structured output and tool calls cost a producer (no Redis, no model).

``python -m benchmarks.structured_producer [--jobs N] [--rounds N]``

Measured, each as the best of ``--rounds`` runs:

- building one job's payload (``PayloadBuilder.build``: the SDK's validation included) without
  a constraint, with a JSON schema already validated once (the cache), and the first time a
  schema is seen (llguidance compiles its grammar without a tokenizer to check it);
- mapping an OpenAI request body (``parse_request``) with ``response_format``, and with three
  tools and ``tool_choice: "required"`` (the forced-call schema built);
- reading tool calls back (``CallReader``): characters per second of a Hermes answer and of a
  forced JSON array, fed whole and in 4-character deltas (a stream's).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Optional, Sequence

from tokenrelay.producer_sdk.openai.format import CHAT_URL, parse_request
from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
from tokenrelay.producer_sdk.openai.structured import ToolPlan
from tokenrelay.producer_sdk.openai.tool_calls import CallReader
from tokenrelay.protocol.keys import Keys

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                         "address": {"type": "object", "required": ["city"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string",
                                                            "pattern": "[0-9]{5}"}}}}}
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
    "type": "object", "required": ["q"], "properties": {"q": {"type": "string"},
                                                        "n": {"type": "integer"}}}}}
         for i in range(3)]
MESSAGES = [{"role": "user", "content": "Extract the person."}]


def per_call_us(fn: Callable[[int], Any], n: int, rounds: int) -> float:
    """Best of ``rounds`` runs of ``n`` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def payload_costs(jobs: int, rounds: int) -> list[tuple[str, float]]:
    b = PayloadBuilder(Keys())
    b.build("warm", max_tokens=8)
    b.build("warm", max_tokens=8, structured_outputs={"json": SCHEMA})

    def cold(i: int) -> Any:     # a schema never seen: a new bound each time
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                           "age": {"type": "integer", "maximum": 1000 + i}}}
        return PayloadBuilder(Keys()).build("x", structured_outputs={"json": schema})
    seen = {"n": 0}

    def cold_unique(_: int) -> Any:
        seen["n"] += 1
        return cold(seen["n"])
    return [
        ("payload, no constraint", per_call_us(lambda i: b.build("x", max_tokens=8), jobs, rounds)),
        ("payload, JSON schema (validated before)", per_call_us(
            lambda i: b.build("x", max_tokens=8, structured_outputs={"json": SCHEMA}), jobs,
            rounds)),
        ("payload, a schema seen for the first time", per_call_us(cold_unique,
                                                                  max(1, jobs // 20), rounds)),
    ]


def mapping_costs(jobs: int, rounds: int) -> list[tuple[str, float]]:
    rf = {"model": "m", "messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}
    tools = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    plain = {"model": "m", "messages": MESSAGES}
    return [(f"parse_request, {name}", per_call_us(
        lambda i, body=body: parse_request(CHAT_URL, body, streaming=True), jobs, rounds))
        for name, body in (("plain", plain), ("response_format json_schema", rf),
                           ("3 tools, tool_choice required", tools))]


def reader_rates(rounds: int) -> list[tuple[str, float]]:
    call = {"name": "tool_1", "arguments": {"q": "the weather in Lisbon " * 4, "n": 7}}
    hermes = ("Sure.\n" + f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" * 20)
    array = json.dumps([call] * 20)
    names = tuple(t["function"]["name"] for t in TOOLS)
    out = []
    for label, plan, text in (("Hermes answer", ToolPlan("auto", names), hermes),
                              ("forced JSON array", ToolPlan("required", names), array)):
        for step in (len(text), 4):
            best = float("inf")
            for _ in range(rounds):
                reader = CallReader(plan)
                t0 = time.perf_counter()
                for at in range(0, len(text), step):
                    reader.feed(text[at:at + step])
                reader.finish()
                best = min(best, time.perf_counter() - t0)
            assert len(reader.calls) == 20
            how = "whole" if step == len(text) else "4-char deltas"
            out.append((f"CallReader, {label}, {how}", len(text) / best))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_producer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="runs; the best is reported")
    args = parser.parse_args(argv)
    print(f"{'what':<58} {'figure':>14}")
    for name, us in payload_costs(args.jobs, args.rounds) + mapping_costs(args.jobs,
                                                                          args.rounds):
        print(f"{name:<58} {us:>10.1f} us")
    for name, rate in reader_rates(args.rounds):
        print(f"{name:<58} {rate / 1e6:>7.2f} M chars/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
