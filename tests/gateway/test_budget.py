"""The gateway under a token budget: one ``tokenrelay gateway --max-queued-tokens``
process, a real redis-server and a ``--model fake:`` worker. While a long job holds most of the
budget, a request whose prompt and max_tokens do not fit is answered 429 ``queue_full`` with
Retry-After, naming the budget, and a small one still runs."""

from __future__ import annotations

import httpx
import pytest

from tests.fault_harness import wait_for
from tests.gateway.helpers import worker_and_gateway

pytestmark = pytest.mark.timeout(120)
BUDGET = 4000


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_and_gateway(tmp_path_factory.mktemp("gateway-budget"), "gb", "gbq",
                            "--max-queued-tokens", str(BUDGET), "--models-refresh-s", "0",
                            "--retry-after-s", "3", max_num_seqs=8) as pair:
        yield pair


def test_429_with_retry_after_past_the_token_budget_small_requests_still_run(env):
    e, gw = env
    with e.client() as c:
        held = c.submit("hold", max_tokens=3800)        # runs ~76 s: holds 3802 tokens
        wait_for(lambda: e.r.xlen(e.keys.results(held.id)) > 0, 30, what="the job started")
        try:
            big = httpx.post(f"{gw.v1}/completions", timeout=30,
                             json={"model": "fake", "prompt": "x" * 300, "max_tokens": 200})
            small = httpx.post(f"{gw.v1}/completions", timeout=30,
                               json={"model": "fake", "prompt": "hi", "max_tokens": 4})
        finally:
            held.cancel()
    assert big.status_code == 429, big.text
    assert big.headers["retry-after"] == "3"
    err = big.json()["error"]
    assert err["code"] == "queue_full" and "token budget" in err["message"]
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 4
    wait_for(lambda: int(e.r.get(e.keys.budget()) or 0) == 0, 30,
             what="the budget released once the held job was cancelled")
