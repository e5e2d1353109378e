"""The gateway in a uvicorn thread on a free port, and the SSE / validation helpers its tests
share. Every server started here is stopped at teardown, also when the test failed."""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import httpx
import uvicorn

from tokenrelay.producer_sdk.gateway import GatewaySettings, create_app
from tokenrelay.producer_sdk.gateway.http import server_config
from tests.fault_harness import FaultEnv, wait_for
from tests.fixtures_redis import free_port

# Fast for tests: the model list is read on every request, keep-alives and headers come quickly.
FAST = dict(models_refresh_s=0.0, keepalive_s=0.2, status_wait_s=0.2)


@dataclass
class Gateway:
    url: str                    # http://127.0.0.1:<port>
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "gateway did not stop"


def start_gateway(redis_url: str, **settings: Any) -> Gateway:
    s = GatewaySettings(redis_url=redis_url, port=free_port(), **{**FAST, **settings})
    return serve(create_app(s), s)


def serve(app: Any, settings: GatewaySettings) -> Gateway:
    """``app`` behind the gateway's own server (http.py's protocol) in a thread, on
    ``settings.port``, once it accepts connections."""
    server = uvicorn.Server(server_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name=f"gateway-{settings.port}")
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), timeout=20, what="gateway up")
    assert server.started, "gateway did not start"
    return Gateway(f"http://127.0.0.1:{settings.port}", server, thread)


def raw_stream(port: int, until: bytes) -> socket.socket:
    """A plain socket that asked ``GET /stream`` and read up to ``until`` (the response's
    headers and first chunk); the caller closes it to leave."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while until not in got:
        data = conn.recv(4096)
        assert data, f"the server closed the connection: {got!r}"
        got += data
    return conn


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """``("comment", text)`` for ``: ...`` lines, ``("data", obj)`` for JSON data, ``("done",
    None)`` for ``data: [DONE]``."""
    for line in lines:
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("data: "):
            payload = line[6:]
            yield ("done", None) if payload == "[DONE]" else ("data", json.loads(payload))


def stream_raw(url: str, body: dict, headers: Optional[dict] = None,
               timeout: float = 60) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    """POST a streaming request with httpx; the response and every SSE event of it."""
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, []
        events = list(sse_events(resp.iter_lines()))
    return resp, events


def completion_chunk_type() -> type:
    """The openai package's ``Completion``, with ``finish_reason`` optional: the package has no
    completion chunk type (its client parses each streamed chunk as a ``Completion`` without
    validating), and OpenAI itself streams ``"finish_reason": null`` until a choice ends.
    Everything else is validated as ``Completion`` validates it."""
    from typing import Literal, Optional

    from openai.types import Completion, CompletionChoice

    class ChunkChoice(CompletionChoice):
        finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None

    class CompletionChunk(Completion):
        choices: list[ChunkChoice]

    return CompletionChunk


def strict_chunks(chat: bool, events: list[tuple[str, Any]]) -> list[Any]:
    """Every data event validated strictly as the openai package's chunk type; the stream
    must end with exactly one ``[DONE]``."""
    from openai.types.chat import ChatCompletionChunk
    assert events and events[-1] == ("done", None), events[-3:]
    assert [k for k, _ in events].count("done") == 1
    model = ChatCompletionChunk if chat else completion_chunk_type()
    return [model.model_validate(obj, strict=True) for kind, obj in events if kind == "data"]


def chunk_texts(chat: bool, chunks: list[Any]) -> dict[int, str]:
    """Each choice's streamed text."""
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            piece = (ch.delta.content if chat else ch.text) or ""
            out[ch.index] = out.get(ch.index, "") + piece
    return out


def finish_reasons(chunks: list[Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            if ch.finish_reason is not None:
                assert ch.index not in out, f"choice {ch.index} finished twice"
                out[ch.index] = ch.finish_reason
    return out


class GatewayProcess:
    """``tokenrelay gateway`` as a child process (its own process group), its
    output in ``log_path``; ``stop()`` (SIGTERM, then SIGKILL) always ends it."""

    def __init__(self, log_path: Any, *args: str, env: Optional[dict] = None) -> None:
        import os
        import subprocess
        import sys

        from tests.fixtures_redis import REPO_ROOT
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrelay.producer_sdk.gateway", "--port", str(self.port),
             "--log-level", "warning", *args], cwd=str(REPO_ROOT), stdout=self._log,
            stderr=subprocess.STDOUT, env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def wait_up(self, timeout: float = 30) -> "GatewayProcess":
        """Until it answers HTTP (any status: Redis may be down on purpose)."""
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + "/metrics", timeout=1)
                return True
            except httpx.HTTPError:
                return False
        wait_for(answers, timeout=timeout, interval=0.1, what="gateway answering")
        return self

    def log(self) -> str:
        try:
            return open(self.log_path, errors="replace").read()[-5000:]
        except OSError:
            return ""

    def stop(self) -> None:
        import os
        import signal
        import subprocess
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@contextmanager
def worker_and_gateway(tmp: Any, namespace: str, queue: str, *flags: str,
                       max_num_seqs: int) -> Iterator[tuple[FaultEnv, GatewayProcess]]:
    """A private redis-server with one fake worker (``w1``, 20 ms steps) and a gateway process on
    it, started with ``flags``; both are ended on exit, also when a test fails."""
    e = FaultEnv(tmp, namespace=namespace, queue=queue)
    gw = None
    try:
        e.worker("w1", delay=0.02, max_num_seqs=max_num_seqs)
        gw = GatewayProcess(tmp / "gateway.log", "--redis-url", e.url, "--namespace", namespace,
                            *flags).wait_up()
        yield e, gw
    finally:
        if gw is not None:
            gw.stop()
        e.close()
