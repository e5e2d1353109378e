"""One JSON log line per gateway request (#40): request id, job id, model, status, TTFT for a
stream, total time; refused requests too; uvicorn's own access lines are off."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fault_harness import wait_for
from tests.gateway.helpers import stream_raw

pytestmark = pytest.mark.timeout(120)
MODEL = "fake"


def request_lines(text: str) -> list[dict]:
    out = []
    for raw in text.splitlines():
        if raw.startswith('{"event": "request"'):
            out.append(json.loads(raw))
    return out


def test_each_request_is_one_json_line(redis_server, start_worker, gateway_factory, capfd):
    start_worker()
    gw = gateway_factory(redis_server.url)
    whole = httpx.post(gw.v1 + "/completions", headers={"X-Request-Id": "r-whole"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    resp, events = stream_raw(gw.v1 + "/completions", {"model": MODEL, "prompt": "hi",
                                                       "max_tokens": 3, "stream": True},
                              headers={"X-Request-Id": "r-stream"})
    missing = httpx.post(gw.v1 + "/completions", headers={"X-Request-Id": "r-404"},
                         json={"model": "nobody", "prompt": "hi"}, timeout=30)
    bad = httpx.post(gw.v1 + "/completions", content=b"x", timeout=30,
                     headers={"X-Request-Id": "r-415", "Content-Type": "text/plain"})
    assert (whole.status_code, resp.status_code, missing.status_code, bad.status_code) == \
        (200, 200, 404, 415)
    seen: dict[str, dict] = {}

    def logged() -> bool:
        seen.update({line["request_id"]: line for line in request_lines(capfd.readouterr().err)})
        return {"r-whole", "r-stream", "r-404", "r-415"} <= set(seen)
    wait_for(logged, 10, what="the four access lines")
    w, s = seen["r-whole"], seen["r-stream"]
    assert (w["status"], w["model"], w["job_id"], w["stream"]) == (
        200, MODEL, whole.headers["x-job-id"], False)
    assert w["ttft_ms"] is None and w["total_ms"] > 0
    assert (s["status"], s["job_id"], s["stream"]) == (200, resp.headers["x-job-id"], True)
    assert 0 < s["ttft_ms"] <= s["total_ms"]
    assert (seen["r-404"]["status"], seen["r-404"]["job_id"], seen["r-404"]["model"]) == \
        (404, None, "nobody")
    assert seen["r-415"]["status"] == 415 and seen["r-415"]["path"] == "/v1/completions"
