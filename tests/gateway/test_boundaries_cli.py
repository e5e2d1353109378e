"""The gateway's import boundary (never torch, the engine or the worker: a producer installs it
without them) and its command line: flags and TOKENRELAY_* variables, exit 2 on a bad value."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.fixtures_redis import REPO_ROOT, free_port
from tests.import_boundaries import forbidden_imports, loaded_packages, module_name, package_files

NOT_FOR_GATEWAY = {"torch", "engine", "worker", "transformers", "triton"}


def test_gateway_source_imports_no_torch_engine_or_worker():
    assert forbidden_imports("producer_sdk/gateway", NOT_FOR_GATEWAY) == []
    assert forbidden_imports("producer_sdk", NOT_FOR_GATEWAY) == []


@pytest.mark.timeout(120)
def test_importing_the_gateway_loads_no_torch_engine_or_worker():
    modules = [module_name(p) for p in package_files("producer_sdk/gateway")]
    assert "tokenrelay.producer_sdk.gateway.app" in modules and "tokenrelay.producer_sdk.gateway.__main__" in modules
    assert loaded_packages(modules) & NOT_FOR_GATEWAY == set()


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    return {**base, "PYTHONPATH": str(REPO_ROOT), **extra}


@pytest.mark.timeout(60)
def test_cli_serves_with_settings_from_flags_and_variables(redis_server):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenrelay.producer_sdk.gateway", "--redis-url", redis_server.url,
         "--log-level", "warning"], cwd=REPO_ROOT, env=_env(TOKENRELAY_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
                assert time.monotonic() < deadline, "the gateway did not answer in 30 s"
                time.sleep(0.1)
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json() == \
            {"object": "list", "data": []}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("args, env, needle", [
    (["--port", "eighty"], {}, "--port / TOKENRELAY_PORT"),
    ([], {"TOKENRELAY_KEEPALIVE_S": "0"}, "--keepalive-s / TOKENRELAY_KEEPALIVE_S"),
    (["--api-keys-file", "/nonexistent/keys"], {}, "--api-keys-file /nonexistent/keys"),
    (["--api-keys", "k notanumber"], {}, "priority 'notanumber' is not an integer"),
    (["--routes", "no-equals-sign"], {}, "route 'no-equals-sign' is not MODEL=QUEUE"),
])
def test_cli_refuses_bad_settings_with_exit_2(args, env, needle):
    done = subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk.gateway", *args], cwd=REPO_ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr
