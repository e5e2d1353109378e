"""The compose stack for real (``make compose-test``; opt-in, never part of ``make test``).

Builds the images with the project's Dockerfile and runs compose.yaml's services with
``docker compose`` (tests/e2e/docker_env.py: a private dockerd when DOCKER_HOST is unset, and
stand-ins for base images no registry can give): Redis, the model service fetching SmolLM2, two
CPU workers serving it, the gateway; then

* a chat through the gateway with the official ``openai`` client (whole and streamed);
* a worker container stopped with SIGTERM mid-job hands the job back, the other finishes it:
  every token exactly once, one terminal event;
* the Redis container restarted keeps the queue (AOF): jobs queued before finish after;
* the batch service runs a file through the queue;
* the CUDA worker image builds (gcc for Triton's launchers is checked by the build) and every
  kernel compiles to an sm_90 cubin inside it: all that can be checked without a GPU
  (TOKENRELAY_COMPOSE_TEST_CUDA=0 leaves it out: it downloads ~3 GB of CUDA wheels when cold);
* ``down -v`` leaves no container, volume or network of the project.

Run with ``TOKENRELAY_COMPOSE_TEST=1`` (make compose-test does); it prints its timings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.docker_env import STANDIN_PYTHON, STATE, Docker, DockerUnavailable
from tests.fault_harness import check_stream, wait_for
from tests.fixtures_redis import free_port

pytestmark = [
    pytest.mark.skipif(os.environ.get("TOKENRELAY_COMPOSE_TEST") != "1",
                       reason="opt-in: make compose-test (TOKENRELAY_COMPOSE_TEST=1)"),
    pytest.mark.timeout(1800),
]

REPO = Path(__file__).resolve().parents[2]
PROJECT = "trcompose"
NAMESPACE = "tokenrelay"
TIMINGS: dict[str, float] = {}


def _pytorch_index_reachable() -> bool:
    try:
        socket.getaddrinfo("download.pytorch.org", 443)
        return True
    except OSError:
        return False


def _prepare_local(standins: list[str]) -> dict[str, str]:
    """docker/local/ for this host (see its README): the host's extra CA certificates (a TLS
    proxy in front of the registries), and torch's CPU wheel when PyTorch's index is out of
    reach (then the CPU build looks on PyPI for the rest). Returns the build args to use."""
    ca = REPO / "docker/local/ca"
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        if not (ca / crt.name).exists():
            shutil.copy(crt, ca / crt.name)
    args: dict[str, str] = {}
    if any(t.startswith("python:") for t in standins):
        args["PYTHON_VERSION"] = STANDIN_PYTHON
    if not _pytorch_index_reachable():
        wheels = REPO / "docker/local/wheels"
        if not list(wheels.glob("torch-2.13.0+cpu-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "--dest", str(wheels), "--only-binary=:all:",
                            "--python-version", args.get("PYTHON_VERSION", "3.12"),
                            "torch==2.13.0+cpu"], check=True, timeout=900)
        args["TORCH_INDEX_URL"] = "https://pypi.org/simple"
    return args


def _override(tmp: Path, build_args: dict[str, str]) -> Path:
    """A compose file over compose.yaml: this host's build args, and the CPU worker's drain
    cut to 1 s so a SIGTERM mid-job hands the job back instead of finishing it."""
    services = {name: {"build": {"args": build_args}}
                for name in ("model", "worker-cpu", "gateway", "batch", "worker-gpu0")}
    services["worker-cpu"]["environment"] = {"TOKENRELAY_DRAIN_TIMEOUT": "1"}
    path = tmp / "compose.test.json"          # JSON is YAML
    path.write_text(json.dumps({"services": services}, indent=2))
    return path


class Stack:
    def __init__(self, docker: Docker, override: Path, tmp: Path) -> None:
        self.docker = docker
        self.files = ["-f", str(REPO / "compose.yaml"), "-f", str(override)]
        self.redis_port, self.gateway_port = free_port(), free_port()
        self.batch_dir = tmp / "batch"
        self.batch_dir.mkdir()
        self.batch_dir.chmod(0o777)                 # the producer image runs as uid 10001
        self.env = {"REDIS_PORT": str(self.redis_port), "GATEWAY_PORT": str(self.gateway_port),
                    "BATCH_DIR": str(self.batch_dir), "COMPOSE_PROJECT_NAME": PROJECT}

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def compose(self, *args: str, timeout: float = 1200, check: bool = True):
        return self.docker.run("compose", *self.files, "-p", PROJECT, *args, cwd=REPO,
                               env=self.env, timeout=timeout, check=check)

    def containers(self, service: str) -> list[dict]:
        out = self.compose("ps", "--all", "--format", "json", service).stdout
        rows = [json.loads(x) for x in out.splitlines() if x.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):
            rows = rows[0]
        return rows

    def wait_healthy(self, service: str, count: int, timeout: float = 600) -> None:
        def ready() -> bool:
            rows = self.containers(service)
            healthy = [r for r in rows if r.get("Health") == "healthy"]
            dead = [r for r in rows if r.get("State") == "exited"]
            if dead:
                logs = self.compose("logs", "--tail", "40", service, check=False).stdout
                raise AssertionError(f"{service} exited: {dead}\n{logs}")
            return len(healthy) >= count
        wait_for(ready, timeout, interval=2.0, what=f"{count} healthy {service}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    t0 = time.monotonic()
    docker = Docker()
    try:
        docker.start()
    except DockerUnavailable as exc:
        pytest.fail(f"Docker cannot run here: {exc}")
    tmp = tmp_path_factory.mktemp("compose")
    s = None
    try:
        text = (REPO / "Dockerfile").read_text()
        py = re.search(r"^ARG PYTHON_VERSION=(\S+)", text, flags=re.M).group(1)
        missing = docker.unavailable([f"python:{py}-slim", "redis:7"])
        # a stand-in for the python image is Debian's Python: build for that version
        standins = [f"python:{STANDIN_PYTHON}-slim" if t.startswith("python:") else t
                    for t in missing]
        docker.build_standins(docker.unavailable(standins))
        build_args = _prepare_local(standins)
        TIMINGS["daemon and base images"] = time.monotonic() - t0
        s = Stack(docker, _override(tmp, build_args), tmp)
        t1 = time.monotonic()
        # one service per image: services sharing an image would each build it (in parallel,
        # with the classic builder); the others then find it built
        s.compose("--profile", "cpu", "build", "gateway")
        s.compose("--profile", "cpu", "build", "worker-cpu")
        TIMINGS["build producer and cpu images"] = time.monotonic() - t1
        t1 = time.monotonic()
        try:
            s.compose("--profile", "cpu", "up", "-d", "--scale", "worker-cpu=2")
        except RuntimeError as exc:
            logs = s.compose("--profile", "cpu", "logs", "--tail", "30", check=False).stdout
            raise RuntimeError(f"{exc}\n--- logs ---\n{logs[-6000:]}") from None
        s.wait_healthy("gateway", 1)
        s.wait_healthy("worker-cpu", 2)
        TIMINGS["up: SmolLM2 fetched, 2 workers and the gateway healthy"] = time.monotonic() - t1
        yield s
    finally:
        if s is not None:
            t1 = time.monotonic()
            s.compose("--profile", "cpu", "--profile", "batch", "--profile", "gpu", "down",
                      "-v", "--remove-orphans", check=False, timeout=300)
            TIMINGS["down -v"] = time.monotonic() - t1
        TIMINGS["total"] = time.monotonic() - t0
        print("\ncompose-test timings (s): " + json.dumps(
            {k: round(v, 1) for k, v in TIMINGS.items()}), flush=True)
        (STATE / "last-timings.json").write_text(json.dumps(TIMINGS, indent=2))
        docker.stop()


def test_a_chat_through_the_gateway_with_the_openai_client(stack):
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{stack.gateway_port}/v1", api_key="unused")
    assert "smollm2" in [m.id for m in client.models.list()]
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "Name a primary colour."}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model="smollm2", max_tokens=12, stream=True,
        messages=[{"role": "user", "content": "Say hello."}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


def test_a_worker_stopped_mid_job_hands_it_back_and_the_other_finishes_it(stack):
    from tokenrelay.producer_sdk import Client
    from tokenrelay.protocol.keys import Keys
    import redis
    tokens = 160
    with Client(stack.redis_url, namespace=NAMESPACE) as client:
        job = client.submit("Tell me a long story about queues.", max_tokens=tokens,
                            temperature=0, ignore_eos=True)
        wait_for(lambda: client.status(job.id).state == "running"
                 and (client.status(job.id).tokens or 0) >= 8, 120, interval=0.2,
                 what="the job running with a few tokens")
        first = client.status(job.id).worker_id        # <container hostname>-cpu
        holder = [c for c in stack.containers("worker-cpu") if first == f"{c['ID'][:12]}-cpu"]
        assert holder, (first, stack.containers("worker-cpu"))
        t0 = time.monotonic()
        stack.docker.run("stop", "--time", "60", holder[0]["ID"])      # SIGTERM, then waits
        TIMINGS["SIGTERM to the worker's exit"] = time.monotonic() - t0
        result = job.result(timeout=300)
    assert result.finish_reason == "length" and len(result.token_ids) == tokens
    r = redis.Redis.from_url(stack.redis_url)
    try:
        report = check_stream(r, Keys(NAMESPACE, "default"), job.id)
    finally:
        r.close()
    assert report.problems == [] and report.kind == "done:length"
    assert len(report.token_ids) == tokens
    assert len({s.worker_id for s in report.started}) == 2, report.started
    assert report.started[-1].resumed_tokens > 0
    inspect = json.loads(stack.docker.run("inspect", holder[0]["ID"]).stdout)[0]
    assert inspect["State"]["ExitCode"] == 0, "a drained worker exits 0"
    stack.compose("--profile", "cpu", "up", "-d", "--scale", "worker-cpu=2")


def test_restarting_the_redis_container_keeps_the_queue(stack):
    """Jobs queued while the workers are frozen survive a restart of the Redis container (AOF);
    thawed, the workers reconnect to the restarted Redis and finish them."""
    from tokenrelay.producer_sdk import Client
    from tokenrelay.protocol.keys import Keys
    import redis
    stack.wait_healthy("worker-cpu", 2)        # the one stopped by the test before is back
    stack.compose("--profile", "cpu", "pause", "worker-cpu")
    try:
        with Client(stack.redis_url, namespace=NAMESPACE) as client:
            ids = [client.submit(f"Count to {i}.", max_tokens=6).id for i in range(3)]
        time.sleep(1.5)                                 # appendfsync everysec
        t0 = time.monotonic()
        stack.compose("restart", "redis")
        stack.wait_healthy("redis", 1, timeout=120)
        TIMINGS["restart the Redis container"] = time.monotonic() - t0
        with Client(stack.redis_url, namespace=NAMESPACE) as client:
            # queued, or delivered to a frozen worker's blocking read (the server answers it
            # for the frozen process): either way still there, as entries and pending lists
            assert {client.status(i).state for i in ids} <= {"queued", "running"}
    finally:
        stack.compose("--profile", "cpu", "unpause", "worker-cpu")
    with Client(stack.redis_url, namespace=NAMESPACE) as client:
        wait_for(lambda: all(client.status(i).state == "done" for i in ids), 300,
                 interval=1.0, what="the jobs queued before the restart done")
    r = redis.Redis.from_url(stack.redis_url)
    try:
        reports = [check_stream(r, Keys(NAMESPACE, "default"), i) for i in ids]
    finally:
        r.close()
    assert all(rep.problems == [] and rep.kind.startswith("done:") for rep in reports)


def test_the_batch_service_runs_a_file_through_the_queue(stack):
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "max_tokens": 8,
                       "messages": [{"role": "user", "content": f"Say {i}."}]}}
             for i in range(4)]
    (stack.batch_dir / "input.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    t0 = time.monotonic()
    stack.compose("--profile", "batch", "run", "--rm", "-T", "batch", timeout=600)
    TIMINGS["batch of 4 chats"] = time.monotonic() - t0
    out = [json.loads(x) for x in (stack.batch_dir / "output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == [f"b{i}" for i in range(4)]
    assert all(x["response"]["status_code"] == 200 for x in out)


@pytest.mark.skipif(os.environ.get("TOKENRELAY_COMPOSE_TEST_CUDA") == "0",
                    reason="TOKENRELAY_COMPOSE_TEST_CUDA=0")
def test_the_cuda_worker_image_builds_and_its_kernels_compile_without_a_gpu(stack):
    t0 = time.monotonic()
    stack.compose("--profile", "gpu", "build", "worker-gpu0", timeout=3600)
    TIMINGS["build the CUDA worker image"] = time.monotonic() - t0
    image = "tokenrelay-worker:cuda"
    versions = stack.docker.run(
        "run", "--rm", "--entrypoint", "python", image, "-c",
        "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
    ).stdout.split()
    assert versions[0].startswith("2.13.0+cu") and versions[1] != "None", versions
    t0 = time.monotonic()
    out = stack.docker.run("run", "--rm", "--entrypoint", "python", image, "-m",
                           "tokenrelay.kernels.compile_check", "--arch", "90", timeout=1200).stdout
    TIMINGS["compile every kernel to sm_90 in the CUDA image"] = time.monotonic() - t0
    assert out.count("sm_90 bf16:") >= 8, out
    launcher = stack.docker.run("run", "--rm", "--entrypoint", "python", image, "-m",
                                "tokenrelay.kernels.compile_check", "--launcher").stdout
    assert "compiles with" in launcher


def test_down_leaves_nothing_behind(stack):
    stack.compose("--profile", "cpu", "--profile", "batch", "--profile", "gpu", "down", "-v",
                  "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    assert stack.docker.run("ps", "-aq", "--filter", label).stdout.strip() == ""
    assert stack.docker.run("volume", "ls", "-q", "--filter", label).stdout.strip() == ""
    assert stack.docker.run("network", "ls", "-q", "--filter", label).stdout.strip() == ""
