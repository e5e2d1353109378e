"""compose.yaml, Dockerfile and .env.example: valid, consistent with the code, and runnable.

No Docker engine runs on our machines, so the stack is checked three ways: against the Compose
Specification's JSON schema, against the project (every flag, variable and file it names exists),
and by running the ``cpu`` and ``batch`` profiles' services as plain processes with the same
commands and environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fault_harness import stop_group, wait_for

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    out = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(value, env: dict[str, str]):
    """Compose-style ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``; ``$$`` is a literal $."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return _VAR.sub(sub, value).replace("$$", "$")


def all_strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in all_strings(v)] + [k for k in node if isinstance(k, str)]
    if isinstance(node, list):
        return [s for v in node for s in all_strings(v)]
    return [node] if isinstance(node, str) else []


def test_compose_validates_against_the_compose_specification():
    schema = json.loads((REPO / "tests/data/compose-spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    broken = yaml.safe_load((REPO / "compose.yaml").read_text())
    broken["services"]["worker"]["stop_grace_period"] = {"seconds": 90}
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def test_redis_service_is_durable_and_reports_loading_as_unhealthy():
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = " ".join(redis["command"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert flag in cmd
    assert any(v.endswith(":/data") for v in redis["volumes"])
    # PING answers LOADING while the AOF replays; the check accepts only PONG.
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


def _finished_job_stream_bytes(server) -> int:
    """MEMORY USAGE of a result stream as a stream=False job leaves it: two entries."""
    r = server.client()
    try:
        r.xadd("result:{j}", {"$event": b"s" * 90, "$batch": "0123456789abcdef.0:1"})
        r.xadd("result:{j}", {"$event": b"d" * 160, "$batch": "0123456789abcdef.1:1"})
        return int(r.memory_usage("result:{j}", samples=0))
    finally:
        r.close()


def test_compose_redis_keeps_a_small_result_stream_small(redis_server_factory):
    """compose.yaml's stream-node-max-bytes, on a real redis-server: Redis preallocates a new
    stream's listpack at min(4096, stream-node-max-bytes), so with the default a finished job's
    two-entry stream held > 4 KB; with compose's setting it holds under 2 KB."""
    cmd = SERVICES["redis"]["command"]
    node_bytes = cmd[cmd.index("--stream-node-max-bytes") + 1]
    default = _finished_job_stream_bytes(redis_server_factory())
    compose = _finished_job_stream_bytes(
        redis_server_factory("--stream-node-max-bytes", node_bytes))
    assert default > 4096 and compose < 2048, (default, compose)


def test_worker_service_shape():
    worker = SERVICES["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["healthcheck"]["test"][-3:] == ["-m", "worker", "health"]
    assert "container_name" not in worker and "ports" not in worker, "must scale with --scale"
    grace = int(worker["stop_grace_period"].rstrip("s"))
    drain = float(interpolate(worker["environment"]["TOKENRELAY_DRAIN_TIMEOUT"], env_example()))
    assert grace > drain
    assert any("huggingface" in v for v in worker["volumes"])
    assert set(SERVICES["worker-cpu"]["profiles"]) == {"cpu"}
    assert set(SERVICES["batch"]["profiles"]) == {"batch"}


def test_every_tokenrelay_variable_is_a_worker_setting():
    from worker.config import WorkerSettings
    fields = set(WorkerSettings.model_fields)
    names = set(env_example())
    for svc in ("worker", "worker-cpu"):
        names |= set(SERVICES[svc]["environment"])
    for name in names:
        if name.startswith("TOKENRELAY_"):
            assert name[len("TOKENRELAY_"):].lower() in fields, name
    # and every .env.example key is used by compose.yaml
    text = (REPO / "compose.yaml").read_text()
    for name in env_example():
        assert name in text, f"{name} in .env.example is not used by compose.yaml"


def test_dockerfile_copies_files_that_exist_and_runs_the_worker():
    text = (REPO / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
    assert 'ENTRYPOINT ["python", "-m", "worker"]' in text
    assert re.search(r"^USER (?!root)\S+", text, flags=re.M), "the image must not run as root"
    assert "ARG DEVICE" in text and "base-cpu" in text


def test_worker_help_accepts_every_flag_the_docs_name():
    help_text = subprocess.run([sys.executable, "-m", "worker", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=REPO).stdout
    for flag in ("--model", "--redis-url", "--namespace", "--queue", "--worker-id", "--device",
                 "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory-bytes", "--max-model-len", "--enable-prefix-caching",
                 "--result-ttl", "--drain-timeout", "--metrics-port", "--lease-ms",
                 "--max-deliveries"):
        assert flag in help_text, flag


def _service_command(name: str) -> list[str]:
    svc = interpolate(SERVICES[name], env_example())
    return list(svc.get("entrypoint") or []) + list(svc.get("command") or [])


@pytest.mark.timeout(420)
def test_cpu_and_batch_profiles_run_as_plain_processes(tmp_path):
    from worker.redis_server import RedisServer

    redis_args = SERVICES["redis"]["command"][1:]
    with RedisServer(redis_args) as server:
        url = server.url
        home = tmp_path / "home"
        home.mkdir()
        env = {**os.environ, **{k: str(v) for k, v in
                                interpolate(SERVICES["worker-cpu"]["environment"], env_example()).items()}}
        env.update(TOKENRELAY_REDIS_URL=url, TOKENRELAY_WORKER_ID="compose-smoke",
                   TOKENRELAY_NAMESPACE="composesmoke", HF_HOME=str(home / "hf"))
        cmd = _service_command("worker-cpu")
        assert cmd[:2] == ["sh", "-c"]
        script = cmd[2].replace("/home/tokenrelay", str(home)).replace("python ", f"{shlex.quote(sys.executable)} ")
        worker = subprocess.Popen(["sh", "-c", script], env=env, cwd=REPO, start_new_session=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(env)
            batch_dir = tmp_path / "batch"
            batch_dir.mkdir()
            with open(batch_dir / "input.jsonl", "w") as f:
                for i in range(12):
                    f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": f"hello {i}", "max_tokens": 4}}) + "\n")
            batch_cmd = [a.replace("/batch", str(batch_dir)) for a in _service_command("batch")]
            assert batch_cmd[:3] == ["python", "-m", "producer_sdk"]
            benv = {**os.environ, "TOKENRELAY_REDIS_URL": url}
            done = subprocess.run([sys.executable, *batch_cmd[1:], "--namespace", "composesmoke"],
                                  env=benv, cwd=REPO, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-2000:]
            lines = [json.loads(x) for x in (batch_dir / "output.jsonl").read_text().splitlines()]
            assert sorted(x["custom_id"] for x in lines) == sorted(f"c{i}" for i in range(12))
            assert all(x["response"]["status_code"] == 200 for x in lines)
        finally:
            stop_group(worker, timeout=30)


def _wait_healthy(env: dict[str, str], timeout: float = 180.0) -> None:
    def healthy() -> bool:
        return subprocess.run([sys.executable, "-m", "worker", "health"], env=env, cwd=REPO,
                              capture_output=True, timeout=30).returncode == 0
    wait_for(healthy, timeout, interval=1.0, what="the cpu worker healthy")


def test_gateway_service_shape_and_settings():
    from producer_sdk.gateway.settings import GatewaySettings
    gw = SERVICES["gateway"]
    assert gw["entrypoint"] == ["python", "-m", "producer_sdk.gateway"]
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
    env = interpolate(gw["environment"], env_example())
    assert env["TOKENRELAY_PORT"] == "8000" and env["TOKENRELAY_HOST"] == "0.0.0.0"
    assert interpolate(gw["ports"], env_example()) == ["127.0.0.1:8000:8000"]
    assert "/health" in " ".join(gw["healthcheck"]["test"]) and ":8000/" in gw["healthcheck"]["test"][-1]
    for name in gw["environment"]:          # every variable is a gateway setting
        assert name.startswith("TOKENRELAY_") and name[11:].lower() in GatewaySettings.model_fields
    GatewaySettings(**{k[11:].lower(): v for k, v in env.items()
                       if k[11:].lower() not in ("api_keys",)})
    assert "gateway" in (REPO / "Dockerfile").read_text().split("pip install")[-1]


@pytest.mark.timeout(120)
def test_gateway_service_runs_as_a_plain_process_and_passes_its_healthcheck(redis_server):
    """The gateway service's command and environment, run here (a free port instead of 8000);
    its healthcheck command exits 0 once it is up and 1 once Redis is gone."""
    from tests.fixtures_redis import free_port
    port = str(free_port())
    env = {**os.environ, **{k: str(v) for k, v in
                            interpolate(SERVICES["gateway"]["environment"], env_example()).items()}}
    env.update(TOKENRELAY_REDIS_URL=redis_server.url, TOKENRELAY_PORT=port,
               TOKENRELAY_HOST="127.0.0.1", PYTHONPATH=str(REPO))
    cmd = _service_command("gateway")
    check = [sys.executable if a == "python" else a.replace(":8000/", f":{port}/")
             for a in SERVICES["gateway"]["healthcheck"]["test"][1:]]
    proc = subprocess.Popen([sys.executable, *cmd[1:]], env=env, cwd=REPO,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: subprocess.run(check, capture_output=True, timeout=10).returncode == 0,
                 60, interval=0.5, what="the gateway's healthcheck to pass")
        redis_server.kill()
        wait_for(lambda: subprocess.run(check, capture_output=True, timeout=10).returncode != 0,
                 30, interval=0.5, what="the healthcheck to fail without Redis")
    finally:
        stop_group(proc)
