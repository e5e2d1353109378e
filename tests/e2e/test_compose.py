"""compose.yaml, Dockerfile and .env.example: valid, consistent with the code, and runnable.

Checked without Docker (``make compose-test`` runs the stack for real:
tests/e2e/test_compose_stack.py): against the Compose Specification's JSON schema; against the
deployment rules (profiles: the cpu profile starts no GPU service; one worker per GPU by device
id; every TOKENRELAY_* of .env reaches its services; Redis has a maxmemory that makes
back-pressure happen; the producer services run the image without torch); against the project
(every flag, variable and file named exists); and by running the ``cpu`` and ``batch``
profiles' services as plain processes with the same commands and environment.
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

def _load_script(path: Path):
    """A script (not a package module) as a module, without putting its folder on sys.path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compose_gpus = _load_script(REPO / "docker" / "compose_gpus.py")


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: ``!override`` / ``!reset`` tags mark how a value merges."""


for _tag in ("!override", "!reset"):
    ComposeLoader.add_constructor(_tag, lambda loader, node: loader.construct_mapping(node)
                                  if isinstance(node, yaml.MappingNode)
                                  else loader.construct_sequence(node))

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


def started(profiles: set[str]) -> set[str]:
    """The services ``docker compose --profile P ... up`` starts."""
    return {name for name, svc in SERVICES.items()
            if not svc.get("profiles") or set(svc["profiles"]) & profiles}


def gpu_devices(svc: dict) -> list[dict]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" or "gpu" in d.get("capabilities", [])]


def service_env(name: str) -> dict[str, str]:
    """What a container of ``name`` sees: its env_file (.env made from .env.example), then its
    environment over it, interpolated as compose does."""
    svc = SERVICES[name]
    env: dict[str, str] = {}
    for entry in svc.get("env_file", []):
        path = entry["path"] if isinstance(entry, dict) else entry
        assert path == ".env", path
        env.update(env_example())
    env.update({k: str(v) for k, v in interpolate(svc.get("environment", {}),
                                                  env_example()).items()})
    return env


TOKENRELAY_SERVICES = {"worker-gpu0": "worker", "worker-cpu": "worker", "gateway": "gateway",
                       "batch": "producer"}


def settings_fields(reader: str) -> set[str]:
    from tokenrelay.producer_sdk.cli.main import BatchOptions
    from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
    from tokenrelay.worker.config import WorkerSettings
    model = {"worker": WorkerSettings, "gateway": GatewaySettings, "producer": BatchOptions}[reader]
    return set(model.model_fields)


def test_compose_validates_against_the_compose_specification():
    schema = json.loads((REPO / "tests/data/compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)      # the schema's own draft
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    generated = yaml.load(compose_gpus.render([0, 1, 2, 3]), Loader=ComposeLoader)
    assert [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(generated)] == []
    broken = yaml.safe_load((REPO / "compose.yaml").read_text())
    broken["services"]["worker-gpu0"]["stop_grace_period"] = {"seconds": 90}
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def test_profiles_cpu_starts_no_gpu_service_and_gpu_no_cpu_worker():
    assert started(set()) == {"redis", "gateway"}
    assert started({"cpu"}) == {"redis", "gateway", "model", "worker-cpu"}
    assert started({"gpu"}) == {"redis", "gateway", "worker-gpu0"}
    assert started({"batch"}) - started(set()) == {"batch"}
    for name in started({"cpu"}) | started({"batch"}):
        assert not gpu_devices(SERVICES[name]), name
        assert service_env(name).get("TOKENRELAY_DEVICE") != "cuda", name
        assert SERVICES[name].get("build", {}).get("target") != "worker-cuda", name
    # the CPU worker serves SmolLM2 from the volume the one-shot model service fills
    cpu, model = SERVICES["worker-cpu"], SERVICES["model"]
    assert model["entrypoint"] == ["tokenrelay", "fetch"]
    assert model["command"] == ["smollm2", "/models/smollm2"] and model["restart"] == "no"
    assert service_env("worker-cpu")["TOKENRELAY_MODEL"] == "/models/smollm2"
    assert cpu["depends_on"]["model"]["condition"] == "service_completed_successfully"
    assert "models:/models:ro" in cpu["volumes"] and "models:/models" in model["volumes"]


def test_one_worker_per_gpu_by_device_index():
    gpu = {name: svc for name, svc in SERVICES.items()
           if gpu_devices(svc) and "tp" not in svc["profiles"]}
    assert set(gpu) == {"worker-gpu0"}
    for name, svc in gpu.items():
        (device,) = gpu_devices(svc)
        assert "count" not in device and device["device_ids"] == ["0"], "pinned by index"
        assert svc["profiles"] == ["gpu"] and service_env(name)["TOKENRELAY_DEVICE"] == "cuda"
        assert service_env(name)["TOKENRELAY_WORKER_ID"] == "tokenrelay-gpu0"
    # the generated workers for 4 GPUs: each a copy of worker-gpu0 on its own GPU, own id
    extra = yaml.load(compose_gpus.render(list(range(4))), Loader=ComposeLoader)["services"]
    assert list(extra) == ["worker-gpu1", "worker-gpu2", "worker-gpu3"]
    ids, workers = {"0"}, {"tokenrelay-gpu0"}
    for i, (name, svc) in enumerate(extra.items(), start=1):
        assert svc["extends"] == {"service": "worker-gpu0", "file": "compose.yaml"}
        (device,) = gpu_devices(svc)
        assert device["device_ids"] == [str(i)] and "count" not in device
        ids.add(device["device_ids"][0])
        workers.add(interpolate(svc["environment"]["TOKENRELAY_WORKER_ID"], env_example()))
    assert ids == {"0", "1", "2", "3"} and len(workers) == 4
    assert "worker-gpu5" in compose_gpus.render([0, 5])
    with pytest.raises(ValueError):
        compose_gpus.render([1, 2])          # GPU 0 is compose.yaml's worker-gpu0
    assert "gpu-memory-utilization" in (REPO / "compose.yaml").read_text().lower().replace(
        "_", "-")


def test_tensor_parallel_worker_spans_its_gpus_with_room_for_nccl():
    """The `tp` profile: one worker over GPUs 0-1 (its size matches its device ids), shared
    memory for NCCL, and never started by the other profiles (it would double-book GPU 0)."""
    tp = SERVICES["worker-tp"]
    assert tp["profiles"] == ["tp"]
    devices = tp["deploy"]["resources"]["reservations"]["devices"][0]
    size = int(re.sub(r"\$\{TP_SIZE:-(\d+)\}", r"\1", tp["environment"]["TOKENRELAY_TENSOR_PARALLEL_SIZE"]))
    assert len(devices["device_ids"]) == size == 2 and "count" not in devices
    assert tp["shm_size"] == "8gb"
    from tokenrelay.worker.config import WorkerSettings
    assert "tensor_parallel_size" in WorkerSettings.model_fields


def test_every_tokenrelay_variable_reaches_the_services_that_read_it():
    """compose passes .env whole (env_file) to every tokenrelay service, so a documented
    setting cannot be dropped by a list of variables that forgot it; each TOKENRELAY_* line of
    .env.example is a setting of some service, and each service's own TOKENRELAY_* values are
    its settings."""
    documented = {k for k in env_example() if k.startswith("TOKENRELAY_")}
    readers: dict[str, set[str]] = {}
    for name, reader in TOKENRELAY_SERVICES.items():
        fields = settings_fields(reader)
        env = service_env(name)
        assert documented <= set(env), (name, documented - set(env))
        for key in SERVICES[name].get("environment", {}):
            assert key.startswith("TOKENRELAY_") and key[11:].lower() in fields, (name, key)
        readers.update({k: readers.get(k, set()) | {name} for k in documented
                        if k[11:].lower() in fields})
    assert set(readers) == documented, documented - set(readers)
    assert {"worker-gpu0", "worker-cpu"} <= readers["TOKENRELAY_MAX_MODEL_LEN"]
    assert {"worker-gpu0", "worker-cpu"} <= readers["TOKENRELAY_SERVED_MODEL_NAME"]
    assert {"worker-gpu0"} <= readers["TOKENRELAY_GPU_MEMORY_UTILIZATION"]
    for name in TOKENRELAY_SERVICES:            # every service works in the stack's namespace
        assert service_env(name)["TOKENRELAY_NAMESPACE"] == env_example()["TOKENRELAY_NAMESPACE"]
        assert service_env(name)["TOKENRELAY_REDIS_URL"] == "redis://redis:6379/0"
    # the other keys of .env.example are compose's own ${...} or a library's variable
    text = (REPO / "compose.yaml").read_text()
    for key in set(env_example()) - documented:
        assert key in text or key == "HF_HUB_OFFLINE", f"{key} in .env.example is used nowhere"


def test_every_worker_flag_in_the_docs_is_a_setting_compose_can_pass():
    from tokenrelay.worker.config import WorkerSettings
    doc = (REPO / "docs" / "operations.md").read_text()
    start = doc.index("### Worker options")
    table = doc[start:doc.index("\n## ", start)]
    variables = re.findall(r"`(TOKENRELAY_[A-Z_]+)`", table)
    assert "TOKENRELAY_GPU_MEMORY_UTILIZATION" in variables
    assert "TOKENRELAY_KV_CACHE_MEMORY_BYTES" in variables
    for var in variables:
        assert var[11:].lower() in WorkerSettings.model_fields, var


def test_empty_variables_in_env_keep_the_defaults():
    """.env.example leaves some settings empty (the default): they must parse as unset."""
    from tokenrelay.worker.config import WorkerSettings
    empty = {k: v for k, v in env_example().items() if k.startswith("TOKENRELAY_") and v == ""}
    assert empty, ".env.example shows optional settings as empty lines"
    env = {k: v for k, v in service_env("worker-gpu0").items() if k.startswith("TOKENRELAY_")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s = WorkerSettings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert s.max_model_len is None and s.served_model_name is None
    assert s.served_model() == "Qwen3-8B"          # the folder's name, not "model"
    assert s.gpu_memory_utilization == 0.9


def test_redis_service_is_durable_bounded_and_reports_loading_as_unhealthy():
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = " ".join(interpolate(redis["command"], env_example()))
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction",
                 f"--maxmemory {env_example()['REDIS_MAXMEMORY']}"):
        assert flag in cmd
    assert "${REDIS_MAXMEMORY" in " ".join(redis["command"]), "sized in .env"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    # PING answers LOADING while the AOF replays; the check accepts only PONG.
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


def test_a_full_compose_redis_is_back_pressure_not_a_crash(tmp_path):
    """compose's Redis settings with a small REDIS_MAXMEMORY, on a real redis-server: once it
    is full a producer gets QueueFull (reason oom), and submits again once memory frees."""
    import redis as redis_py

    from tokenrelay.producer_sdk import Client, QueueFull
    from tests.fixtures_redis import start_redis_server
    args = interpolate(SERVICES["redis"]["command"], {**env_example(), "REDIS_MAXMEMORY": "2mb"})
    server = start_redis_server(tmp_path, *args[1:])
    try:
        with server.client() as r:
            i = 0
            with pytest.raises(redis_py.exceptions.OutOfMemoryError):
                while True:
                    r.set(f"fill{i}", b"x" * 1000)
                    i += 1
            with Client(server.url) as c:
                with pytest.raises(QueueFull) as err:
                    c.submit("hi")
                assert err.value.reason == "oom"
                r.delete(*[f"fill{k}" for k in range(i)])
                assert c.submit("hi").id
    finally:
        server.kill()


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
    for name in ("worker-gpu0", "worker-cpu"):
        worker = SERVICES[name]
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["healthcheck"]["test"] == ["CMD", "tokenrelay", "health"]
        assert "container_name" not in worker and "ports" not in worker
        grace = int(worker["stop_grace_period"].rstrip("s"))
        assert grace > float(service_env(name)["TOKENRELAY_DRAIN_TIMEOUT"])
    assert any("huggingface" in v for v in SERVICES["worker-gpu0"]["volumes"])
    assert set(SERVICES["batch"]["profiles"]) == {"batch"}


def dockerfile_stages() -> dict[str, str]:
    """Each ``FROM ... AS name`` stage's text, by name."""
    text = (REPO / "Dockerfile").read_text()
    parts = re.split(r"^FROM ", text, flags=re.M)[1:]
    return {re.match(r"\S+ AS (\S+)", p).group(1): p for p in parts}


def test_dockerfile_targets_copies_and_pins():
    text = (REPO / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, flags=re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
    stages = dockerfile_stages()
    for svc in SERVICES.values():
        if "build" in svc:
            assert svc["build"]["target"] in stages, svc["build"]
    for target in ("producer", "worker-cpu", "worker-cuda"):
        assert re.search(r"^USER (?!root)\S+", stages[target], flags=re.M), target
    for target in ("worker-cpu", "worker-cuda"):
        assert 'ENTRYPOINT ["tokenrelay", "worker"]' in stages[target], target
    assert 'ENTRYPOINT ["tokenrelay"]' in stages["producer"]
    # every image installs the project's wheel (the tokenrelay namespace, its console script) and
    # takes its dependencies at the lock's versions; none puts a folder of ours on a path
    for target in ("producer", "worker-cpu", "worker-cuda"):
        assert "--from=project-wheel" in stages[target] and "PYTHONPATH" not in stages[target]
    assert "PIP_CONSTRAINT=/tmp/project/requirements.lock" in stages["deps"]
    # CUDA: a compiler for Triton's launchers, checked at build; torch and triton pinned
    assert "gcc" in stages["worker-cuda"] and "compile_check --launcher" in stages["worker-cuda"]
    assert '"/tmp/project[worker,gpu,fetch]"' in stages["deps-cuda"]
    assert "TORCH_VERSION=2.13.0" in stages["deps-cuda"] + stages["deps-cpu"]
    # CPU: torch's +cpu build from PyTorch's CPU index, no triton
    assert "+cpu" in stages["deps-cpu"] and "download.pytorch.org/whl/cpu" in stages["deps-cpu"]
    assert "gpu" not in stages["deps-cpu"].split("/tmp/project[")[1].split("]")[0]


def test_gateway_and_batch_run_the_producer_image_without_torch():
    import tomllib
    stages = dockerfile_stages()
    for name in ("gateway", "batch"):
        assert SERVICES[name]["build"]["target"] == "producer"
        assert SERVICES[name]["image"] == "tokenrelay-producer"
    assert "--from=deps-producer" in stages["producer"] and "engine" not in stages["producer"]
    assert '"/tmp/project[gateway]"' in stages["deps-producer"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["gateway"]
    assert not [d for d in deps if re.match(r"(torch|triton|transformers)\b", d)]


def test_worker_help_accepts_every_flag_the_docs_name():
    help_text = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=REPO).stdout
    for flag in ("--model", "--redis-url", "--namespace", "--queue", "--worker-id", "--device",
                 "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--max-model-len",
                 "--enable-prefix-caching",
                 "--result-ttl", "--drain-timeout", "--metrics-port", "--lease-ms",
                 "--max-deliveries"):
        assert flag in help_text, flag


def _service_command(name: str) -> list[str]:
    """The service's entrypoint (its own, else its image's) and command, interpolated."""
    svc = interpolate(SERVICES[name], env_example())
    entry = svc.get("entrypoint")
    if entry is None:
        stage = dockerfile_stages()[svc["build"]["target"]]
        entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", stage, flags=re.M).group(1))
    return list(entry) + list(svc.get("command") or [])


def _local(cmd: list[str]) -> list[str]:
    """A container's command as this interpreter runs it: the images' ``tokenrelay`` console
    script is ``python -m tokenrelay`` (the same entry point)."""
    assert cmd[0] == "tokenrelay", cmd
    return [sys.executable, "-m", "tokenrelay", *cmd[1:]]


@pytest.mark.timeout(420)
def test_cpu_and_batch_profiles_run_as_plain_processes(tmp_path):
    """The cpu profile's services in order, as processes: the one-shot model service fetches
    SmolLM2 (reused when .models/smollm2 is complete), the worker serves it with the service's
    environment (.env included), and the batch service runs a file through it."""
    from devtools.redis_server import RedisServer

    models = REPO / ".models"
    fetch = [a.replace("/models", str(models)) for a in _service_command("model")]
    assert fetch[:2] == ["tokenrelay", "fetch"]
    done = subprocess.run(_local(fetch), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with RedisServer(SERVICES["redis"]["command"][1:3]) as server:
        url = server.url
        env = {**os.environ, **service_env("worker-cpu")}
        env.update(TOKENRELAY_REDIS_URL=url, TOKENRELAY_WORKER_ID="compose-smoke",
                   TOKENRELAY_NAMESPACE="composesmoke", TOKENRELAY_METRICS_PORT="0",
                   TOKENRELAY_MODEL=env["TOKENRELAY_MODEL"].replace("/models", str(models)),
                   HF_HOME=str(tmp_path / "hf"))
        cmd = _service_command("worker-cpu")
        assert cmd == ["tokenrelay", "worker"]
        worker = subprocess.Popen(_local(cmd), env=env, cwd=REPO,
                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            _wait_healthy(env)
            batch_dir = tmp_path / "batch"
            batch_dir.mkdir()
            with open(batch_dir / "input.jsonl", "w") as f:
                for i in range(12):
                    f.write(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                        "url": "/v1/completions",
                                        "body": {"model": "smollm2", "prompt": f"hello {i}",
                                                 "max_tokens": 4}}) + "\n")
            batch_cmd = [a.replace("/batch", str(batch_dir)) for a in _service_command("batch")]
            assert batch_cmd[:2] == ["tokenrelay", "batch"]
            benv = {**os.environ, **service_env("batch"), "TOKENRELAY_REDIS_URL": url,
                    "TOKENRELAY_NAMESPACE": "composesmoke"}
            done = subprocess.run(_local(batch_cmd), env=benv, cwd=REPO,
                                  capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-2000:]
            lines = [json.loads(x) for x in (batch_dir / "output.jsonl").read_text().splitlines()]
            assert sorted(x["custom_id"] for x in lines) == sorted(f"c{i}" for i in range(12))
            assert all(x["response"]["status_code"] == 200 for x in lines)
        finally:
            stop_group(worker, timeout=30)


def _wait_healthy(env: dict[str, str], timeout: float = 240.0) -> None:
    def healthy() -> bool:
        return subprocess.run(_local(SERVICES["worker-cpu"]["healthcheck"]["test"][1:]), env=env, cwd=REPO,
                              capture_output=True, timeout=30).returncode == 0
    wait_for(healthy, timeout, interval=1.0, what="the cpu worker healthy")


def test_gateway_service_shape_and_settings():
    from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
    gw = SERVICES["gateway"]
    assert gw["entrypoint"] == ["tokenrelay", "gateway"]
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
    env = interpolate(gw["environment"], env_example())
    assert env["TOKENRELAY_PORT"] == "8000" and env["TOKENRELAY_HOST"] == "0.0.0.0"
    assert interpolate(gw["ports"], env_example()) == ["127.0.0.1:8000:8000"]
    assert "/health" in " ".join(gw["healthcheck"]["test"]) and ":8000/" in gw["healthcheck"]["test"][-1]
    for name in gw["environment"]:          # every variable is a gateway setting
        assert name.startswith("TOKENRELAY_") and name[11:].lower() in GatewaySettings.model_fields
    GatewaySettings(**{k[11:].lower(): v for k, v in env.items()
                       if k[11:].lower() not in ("api_keys",)})
    assert "[gateway]" in dockerfile_stages()["deps-producer"]


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
    proc = subprocess.Popen(_local(cmd), env=env, cwd=REPO,
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
