"""The gateway's pure parts: request mapping (streaming fields, no max_tokens default for
chat), served model names, routes, keys, logprob shapes."""

from __future__ import annotations

import pytest

from tokenrelay.producer_sdk.gateway.auth import KeyFileError, KeyRing, bearer_token, load_keys
from tokenrelay.producer_sdk.gateway.models import parse_routes
from tokenrelay.protocol.logprobs import TokenLogprob, TopLogprob
from tokenrelay.producer_sdk.openai.format import (CHAT_URL, COMPLETIONS_URL, LineError, chat_logprobs,
                                        completion_logprobs, parse_request,
                                        token_logprobs_from_ids)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_without_max_tokens_sends_none_and_streaming_fields_map():
    req = parse_request(CHAT_URL, {**CHAT, "stream": True,
                                   "stream_options": {"include_usage": True}, "user": "u7"},
                        streaming=True)
    assert "max_tokens" not in req.kwargs and req.kwargs["messages"] == CHAT["messages"]
    assert (req.stream, req.include_usage, req.user, req.model, req.chat) == \
        (True, True, "u7", "m", True)
    comp = parse_request(COMPLETIONS_URL, {"model": "m", "prompt": "x", "max_tokens": 3,
                                           "top_k": 5, "min_p": 0.1, "logprobs": 2},
                         streaming=True)
    assert comp.kwargs == {"prompt": "x", "max_tokens": 3, "top_k": 5, "min_p": 0.1,
                           "logprobs": 2}
    assert comp.logprobs and not comp.stream


@pytest.mark.parametrize("body, param", [
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),      # a tool needs its function
    ({"user": 5}, "user"),
])
def test_request_errors_name_the_field(body, param):
    with pytest.raises(LineError) as exc:
        parse_request(CHAT_URL, {**CHAT, **body}, streaming=True)
    assert exc.value.param == param


def test_a_batch_line_cannot_stream():
    with pytest.raises(LineError) as exc:
        parse_request(CHAT_URL, {**CHAT, "stream": True}, streaming=False)
    assert (exc.value.code, exc.value.param) == ("unsupported_field", "stream")


def test_routes_are_model_equals_queue():
    assert parse_routes(["a=q1", "org/model=q2"]) == {"a": "q1", "org/model": "q2"}
    for bad in ("noequals", "=q", "m=", "m=has:colon"):
        with pytest.raises(ValueError):
            parse_routes([bad])


def test_keys_priorities_and_bearer(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nk-file 2  # trailing\n\n")
    ring = KeyRing(load_keys(["k-a", "k-b -1"], str(f)))
    assert [(k.key, k.priority) for k in ring.keys] == [("k-a", None), ("k-b", -1),
                                                         ("k-file", 2)]
    assert ring.find("k-b").priority == -1 and ring.find("nope") is None
    assert ring.find(None) is None and not KeyRing([]).enabled
    assert bearer_token("Bearer  k-a ") == "k-a" and bearer_token("Basic x") is None
    with pytest.raises(KeyFileError, match="line 1"):
        f.write_text("a b c\n")
        load_keys([], str(f))


def test_logprob_shapes_from_records_and_from_ids():
    rec = TokenLogprob(token_id=5, token="hé", bytes=[104, 195, 169], logprob=-0.1,
                       top_logprobs=[TopLogprob(token_id=5, token="hé", bytes=[104, 195, 169],
                                                logprob=-0.1),
                                     TopLogprob(token_id=6, token="ha", logprob=-2.5)])
    chat = chat_logprobs([rec], top=1)
    assert chat["content"] == [{"token": "hé", "bytes": [104, 195, 169], "logprob": -0.1,
                                "top_logprobs": [{"token": "hé", "bytes": [104, 195, 169],
                                                  "logprob": -0.1}]}]
    comp = completion_logprobs([rec, rec], top=2, text_offset=3)
    assert comp["text_offset"] == [3, 5] and comp["top_logprobs"][0] == {"hé": -0.1, "ha": -2.5}
    (fallback,) = token_logprobs_from_ids([7], [{9: -0.2, 7: -1.0}])
    assert fallback.token == "token_id:7" and fallback.logprob == -1.0
    assert [t.token for t in fallback.top_logprobs] == ["token_id:9", "token_id:7"]
    assert chat_logprobs([TokenLogprob(token_id=1, token="x", logprob=float("-inf"))],
                         0)["content"][0]["logprob"] == -9999.0


def test_a_disconnect_runs_the_requests_hook_as_it_is_read():
    """A streamed answer owes its job's cancel in the loop turn that reads the disconnect, not
    a turn later once its task unwound (#42); the hook runs once, and for nothing else."""
    import asyncio

    from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT, noticing_disconnect

    async def run() -> list[str]:
        messages: asyncio.Queue = asyncio.Queue()
        ran: list[str] = []
        state = {ON_DISCONNECT: lambda: ran.append("cancel owed")}
        receive = noticing_disconnect(messages.get, state)
        for kind in ("http.request", "http.disconnect", "http.disconnect"):
            messages.put_nowait({"type": kind})
            assert (await receive())["type"] == kind
            ran.append(f"read {kind}")
        return ran
    assert asyncio.run(run()) == ["read http.request", "cancel owed", "read http.disconnect",
                                  "read http.disconnect"]
