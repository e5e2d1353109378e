"""Securing Redis, black-box: the least-privilege ACL users of docs/operations.md and TLS.

Every test starts its own redis-server: with an ACL file whose default user is disabled (only the
role users below plus a ``root`` user the test itself uses to set up and read ``ACL LOG``), or with
TLS on a port of its own (``--port 0``) and a CA, server and client certificate generated here
with the ``openssl`` CLI. The worker (``tokenrelay worker --model fake:``), the SDK, the admin
commands and the health probe run as real processes under exactly those users.

The rule sets in ``ROLE_COMMANDS`` are the ones docs/operations.md prints: when a role needs a new
Redis command, ``ACL LOG`` shows it here first (every test asserts no role command was denied).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest
import redis

from tokenrelay.protocol.keys import Keys, PAYLOAD_FIELD
from tests.fault_harness import kill_group, wait_for
from tests.fixtures_redis import REDIS_SERVER_BIN, REPO_ROOT, WorkerProcess, free_port
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(180)

# --------------------------------------------------------------------------------------------
# the rule sets (docs/operations.md, "Securing Redis", prints these)
# --------------------------------------------------------------------------------------------

ROLE_COMMANDS: dict[str, tuple[str, ...]] = {
    # tokenrelay worker (and tokenrelay health, which reads the heartbeat hash);
    # cluster|info: --cluster auto asks the server; hsetnx: the first worker registers the
    # shard count
    "worker": ("ping", "cluster|info", "evalsha", "eval",
               "xgroup|create", "xreadgroup", "xinfo|groups", "xadd", "xack", "xdel", "xclaim",
               # departed workers leave the groups: listed, then removed by a script
               "xinfo|consumers", "xgroup|delconsumer",
               "xautoclaim", "xpending", "xrange", "xrevrange",
               "get", "set", "mget", "exists", "del", "pexpire",
               "hset", "hsetnx", "hget", "hgetall", "zadd", "zrem", "sadd",
               # the affinity sweep reads the registry and its own streams' lengths; every beat
               # reads the server's run id (a restart without an error)
               "zrange", "xlen", "info",
               # the terminal write returns the job's cost to the token budget
               "decrby",
               # one model per queue: a worker reads its queue's live heartbeats at start and
               # every 10 beats (worker/model_guard.py)
               "hmget"),
    # producer_sdk.Client / AsyncClient / tokenrelay submit|cancel|batch|status
    # (status and reattach read the job's pending row, last event and the lanes' groups;
    # producer_sdk.core.models and the batch runner's routing read the queues, registries and beats)
    "producer": ("ping", "evalsha", "script|load", "xadd", "xlen", "xread", "xrange",
                 "xrevrange", "xpending", "xinfo|groups", "get", "set", "exists", "hget",
                 "multi", "exec", "smembers", "zrange", "hmget", "cluster|info", "wait",
                 # the shard count registered before the first enqueue; the cancel script
                 # caps the flag's TTL by the job's records
                 "hsetnx", "pttl",
                 # asyncio clients and the gateway: their shared readers' wake streams
                 "pexpire",
                 # the enqueue script: the token budget's counter; a known job's entry undone
                 "incrby", "xdel",
                 # the gateway's resumable streams: their records (and the scripts' clock),
                 # the parked streams every gateway sweeps
                 "hset", "time", "zadd", "zrangebyscore", "zrem"),
    # tokenrelay admin ... and tokenrelay stats --queue Q
    "admin": ("evalsha", "eval", "xpending", "xrange", "xadd", "xdel", "xlen", "xinfo|groups",
              "get", "set", "exists", "del", "hget", "hset", "zrange", "zcount", "zcard",
              "cluster|info",
              # recount-budget: whether a pending job's stream already ended
              "xrevrange"),
}
# What every role also needs on a Redis Cluster (docs/operations.md, "Redis Cluster and hash
# tags"): the cluster client reads the slot map and the commands' key positions when it
# connects, and sends ASKING after an ASK redirect (tests/faults/test_cluster.py runs the
# worker, health and admin under the worker and admin rules plus these).
CLUSTER_COMMANDS: tuple[str, ...] = ("cluster|slots", "command", "asking")
# redis-py sends CLIENT SETINFO on connect and ignores a refusal; Redis 7.2+ logs the refusal.
IGNORED_DENIALS = frozenset({"client|setinfo"})


def acl_rule(role: str, namespace: str, password: str) -> str:
    """The ACL rule of one role user, confined to one namespace's keys, no pub/sub channels."""
    cmds = " ".join(f"+{c}" for c in ROLE_COMMANDS[role])
    return f"on >{password} resetkeys ~{namespace}:* resetchannels -@all {cmds}"


def test_operations_doc_prints_exactly_the_tested_rules():
    """docs/operations.md, "Securing Redis", shows one ``user`` line per role: each must be the
    rule these tests run under (for namespace ``tokenrelay``), so the doc cannot drift."""
    doc = (REPO_ROOT / "docs" / "operations.md").read_text()
    printed = {}
    for line in doc.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] == "user" and parts[1] in ROLE_COMMANDS:
            printed[parts[1]] = " ".join(parts[2].split())
    assert set(printed) == set(ROLE_COMMANDS), printed
    for role, rule in printed.items():
        password = rule.split()[1][1:]
        assert rule == acl_rule(role, "tokenrelay", password), role
    assert "user default off" in doc
    assert " ".join(f"+{c}" for c in CLUSTER_COMMANDS) in " ".join(doc.split())


@dataclass(frozen=True)
class User:
    name: str
    password: str

    def url(self, port: int, scheme: str = "redis", query: str = "") -> str:
        return f"{scheme}://{self.name}:{self.password}@127.0.0.1:{port}/0" + (
            f"?{query}" if query else "")


ROOT = User("root", "root-secret")


def role_users(namespace: str, suffix: str = "") -> dict[str, User]:
    return {role: User(f"{role}{suffix}", f"{role}{suffix}-pw") for role in ROLE_COMMANDS}


# --------------------------------------------------------------------------------------------
# a redis-server with an ACL file or TLS, and processes under its users
# --------------------------------------------------------------------------------------------

@dataclass
class SecureRedis:
    """One redis-server child (own process group) that the test reaches as ``root``."""

    workdir: Path
    extra: Sequence[str]
    tls: Optional["Certs"] = None
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    def start(self) -> "SecureRedis":
        self.workdir.mkdir(parents=True, exist_ok=True)
        port_args = (["--port", "0", "--tls-port", str(self.port)] if self.tls
                     else ["--port", str(self.port)])
        cmd = [REDIS_SERVER_BIN, *port_args, "--bind", "127.0.0.1", "--dir", str(self.workdir),
               "--save", "", "--appendonly", "no", "--daemonize", "no",
               "--logfile", str(self.workdir / "redis.log"), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client(socket_timeout=1).ping():
                    return self
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} not ready:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self) -> str:
        try:
            return "\n".join((self.workdir / "redis.log").read_text().splitlines()[-15:])
        except OSError:
            return ""

    def client(self, user: User = ROOT, **kw) -> redis.Redis:
        if self.tls is not None:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls.ca), ssl_certfile=str(self.tls.client),
                      ssl_keyfile=str(self.tls.client_key))
        return redis.Redis(host="127.0.0.1", port=self.port, username=user.name,
                           password=user.password, **kw)

    def denials(self) -> list[dict]:
        """ACL LOG entries of every user but root, minus what redis-py itself ignores."""
        out = []
        for e in self.client().acl_log():
            obj = e.get("object", "")
            if e.get("username") != ROOT.name and obj not in IGNORED_DENIALS:
                out.append({k: e.get(k) for k in ("username", "context", "reason", "object",
                                                  "count")})
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
            self.proc.wait(10)


def report_denials(srv: SecureRedis) -> None:
    """Printed at teardown (pytest shows it with a failure): what a role was refused."""
    try:
        print("ACL denials:", json.dumps(srv.denials(), default=str))
    except redis.RedisError as exc:
        print("ACL LOG unreadable:", exc)


def write_acl_file(path: Path, rules: dict[str, str]) -> Path:
    lines = ["user default off resetkeys resetchannels -@all",
             f"user {ROOT.name} on >{ROOT.password} ~* &* +@all"]
    lines += [f"user {name} {rule}" for name, rule in rules.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Procs:
    """Workers and one-shot commands of one test; every worker is SIGKILLed at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.workers: list[WorkerProcess] = []

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        return {**base, "PYTHONUNBUFFERED": "1", **extra}

    def worker(self, url: str, namespace: str, worker_id: str, *flags: str,
               env: Optional[dict[str, str]] = None, step_delay: float = 0.01,
               max_deliveries: int = 3, module: str = "tokenrelay.worker") -> WorkerProcess:
        """``tokenrelay worker`` (``module="tests.fault_worker"``: the same with the test-only
        fault injection of TOKENRELAY_FAULT_INJECT)."""
        args = ("--model", f"fake:step_delay={step_delay}", "--redis-url", url,
                "--namespace", namespace, "--queue", "q", "--worker-id", worker_id,
                "--lease-ms", "1000", "--heartbeat-ms", "200", "--block-ms", "100",
                "--max-deliveries", str(max_deliveries), "--drain-timeout", "0.5", "--result-ttl", "300",
                "--device", "cpu", "--log-level", "debug", *flags)
        wp = WorkerProcess(args=args, env=self.env(**(env or {})), module=module,
                           log_path=self.tmp_path / f"{worker_id}-{len(self.workers)}.log")
        self.workers.append(wp)
        return wp.start()

    def run(self, module: str, *argv: str, env: Optional[dict[str, str]] = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *argv], cwd=str(REPO_ROOT),
                              env=self.env(**(env or {})), capture_output=True, text=True,
                              timeout=timeout)

    def close(self) -> None:
        for wp in self.workers:
            wp.kill()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


NS_A, NS_B = "tenant-a", "tenant-b"


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[tuple[SecureRedis, dict[str, User], dict[str, User]]]:
    """Two tenants, each with its worker, producer and admin users; default user disabled."""
    users_a, users_b = role_users(NS_A, "-a"), role_users(NS_B, "-b")
    rules = {u.name: acl_rule(role, NS_A, u.password) for role, u in users_a.items()}
    rules.update({u.name: acl_rule(role, NS_B, u.password) for role, u in users_b.items()})
    aclfile = write_acl_file(tmp_path / "users.acl", rules)
    srv = SecureRedis(tmp_path / "redis", ["--aclfile", str(aclfile)])
    try:
        yield srv.start(), users_a, users_b
    finally:
        report_denials(srv)
        srv.kill()


def sdk_client(url: str, namespace: str):
    from tokenrelay.producer_sdk.client import Client
    return Client(url, queue="q", namespace=namespace)


def results_of(srv: SecureRedis, keys: Keys, job_id: str) -> list:
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    return [decode_event(f[EVENT_FIELD]) for _, f in srv.client().xrange(keys.results(job_id))]


def error_lines(log: str) -> list[str]:
    """JSON log lines at error level or above (the worker's logs are structlog JSON)."""
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") in ("error", "critical"):
            out.append(line)
    return out


def assert_config_exit(wp: WorkerProcess, *words: str) -> None:
    """Contract 2: a permanent Redis configuration error ends the worker with exit code 78
    after ONE clear error line that names the cause (no retry loop, no traceback)."""
    try:
        rc = wp.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError("worker still running after 60 s on a permanent configuration "
                             "error (it retries forever):\n" + wp.log()[-2000:]) from None
    log = wp.log()
    assert rc == 78, f"exit code {rc}, expected 78:\n{log[-2000:]}"
    assert "Traceback" not in log, log[-2000:]
    lines = error_lines(log)
    assert len(lines) == 1, f"expected one error line, got {len(lines)}:\n" + "\n".join(lines)
    assert any(w.lower() in lines[0].lower() for w in words), (
        f"the error line names none of {words}: {lines[0]}")


# --------------------------------------------------------------------------------------------
# ACL: every role under its least-privilege user
# --------------------------------------------------------------------------------------------

def test_acl_users_run_worker_sdk_admin_and_health(acl_redis, procs):
    """Worker, SDK (submit, stream, result, cancel, reattach), admin (pending, workers, dead
    list/replay/purge, drain, stats) and health, each as its own least-privilege user, with the
    default user disabled; paths covered: jobs run, cancel, invalid payload and poison
    dead-letters, drain with hand-back (parking) and reclaim after a SIGKILL."""
    from tokenrelay.producer_sdk.errors import JobFailed
    srv, users, _ = acl_redis
    keys = Keys(NS_A, "q")
    w_url, p_url, a_url = (users[r].url(srv.port) for r in ("worker", "producer", "admin"))
    with pytest.raises(redis.AuthenticationError):   # the default user is off
        redis.Redis(port=srv.port).ping()

    client = sdk_client(p_url, NS_A)
    try:
        client.ping()
        # a worker whose engine fails on the poison prompt dead-letters it and exits 1
        w0 = procs.worker(w_url, NS_A, "w0", max_deliveries=1, module="tests.fault_worker",
                          env={"TOKENRELAY_FAULT_INJECT": "raise_on_prompt:POISON"})
        poison = client.submit("POISON here", max_tokens=8, temperature=0.0, job_id="s4")
        assert w0.wait(120) == 1, w0.log()[-2000:]
        with pytest.raises(JobFailed):
            poison.result(timeout=30)

        w1 = procs.worker(w_url, NS_A, "w1")
        w1.wait_for_log("worker ready", timeout=120)
        streamed = client.submit("hello acl", max_tokens=8, temperature=0.0, job_id="s1")
        whole = client.submit("whole acl", max_tokens=8, stream=False, temperature=0.0, job_id="s2")
        long = client.submit("long acl", max_tokens=3000, temperature=0.0, job_id="s3")
        text = "".join(d.text for d in streamed.stream(timeout=60))
        assert text == fake_completion("hello acl", 8)
        assert whole.result(timeout=60).text == fake_completion("whole acl", 8)
        wait_for(lambda: len(results_of(srv, keys, "s3")) > 2, 30, what="s3 running")
        long.cancel()
        assert long.result(timeout=60).finish_reason == "cancelled"
        assert client.get("s1").result(timeout=10).text == text        # reattach by id
        assert client.status("s1").state == "done"                      # status by id
        queued = client.submit("waits for nobody", max_tokens=2, job_id="s1q", priority=7)
        assert client.status(queued.id).state in ("queued", "running", "done")
        srv.client().xadd(keys.lane("default"), {PAYLOAD_FIELD: b"\xc1 not msgpack"})

        # health as the worker user; admin commands as the admin user
        health = procs.run("tokenrelay", "health", "--redis-url", w_url, "--namespace", NS_A,
                           "--queue", "q", "--worker-id", "w1", "--heartbeat-ms", "200")
        assert health.returncode == 0, health.stdout + health.stderr
        admin = ("--redis-url", a_url, "--namespace", NS_A, "--queue", "q", "--json")
        wait_for(lambda: len(srv.client().xrange(keys.dead())) >= 2, 30, what="two dead letters")
        for cmd in (("pending",), ("workers",), ("dead", "list"), ("recount-budget",)):
            out = procs.run("tokenrelay", "admin", *admin, *cmd)
            assert out.returncode == 0, (cmd, out.stderr)
        dead = json.loads(procs.run("tokenrelay", "admin", *admin, "dead", "list").stdout)
        assert {d["job_id"] for d in dead} >= {"s4"}
        poison_dead = [d["dead_id"] for d in dead if d["job_id"] == "s4"]
        replay = procs.run("tokenrelay", "admin", *admin, "dead", "replay", *poison_dead)
        assert replay.returncode == 0, replay.stderr
        assert "replayed s4" in replay.stdout, replay.stdout   # its outcome: test_hostile
        purge = procs.run("tokenrelay", "admin", *admin, "dead", "purge", "--all")
        assert purge.returncode == 0, purge.stderr
        stats = procs.run("tokenrelay", "stats", "--redis-url", a_url, "--namespace", NS_A,
                          "--queue", "q", "--json")
        assert stats.returncode == 0, stats.stdout + stats.stderr

        # drain: w1 hands its running job back, w2 takes it over and finishes it
        drained = client.submit("drained acl", max_tokens=300, temperature=0.0, job_id="s5")
        wait_for(lambda: len(results_of(srv, keys, "s5")) > 3, 30, what="s5 running on w1")
        pending = json.loads(procs.run("tokenrelay", "admin", *admin, "pending").stdout)
        assert [(p["job_id"], p["consumer"]) for p in pending] == [("s5", "w1")], pending
        assert pending[0]["owner"].startswith("w1:"), pending
        w2 = procs.worker(w_url, NS_A, "w2")
        w2.wait_for_log("worker ready", timeout=120)
        out = procs.run("tokenrelay", "admin", "--redis-url", a_url, "--namespace", NS_A,
                        "--queue", "q", "drain", "w1")
        assert out.returncode == 0, out.stderr
        assert w1.wait(60) == 0, w1.log()[-2000:]
        assert drained.result(timeout=60).text == fake_completion("drained acl", 300)

        # reclaim: w2 dies holding a job, w3 takes it after the lease
        victim = client.submit("reclaimed acl", max_tokens=300, temperature=0.0, job_id="s6")
        wait_for(lambda: len(results_of(srv, keys, "s6")) > 3, 30, what="s6 running on w2")
        w2.kill()
        procs.worker(w_url, NS_A, "w3").wait_for_log("worker ready", timeout=120)
        assert victim.result(timeout=60).text == fake_completion("reclaimed acl", 300)
    finally:
        client.close()
    assert srv.denials() == []


def test_a_producer_cannot_touch_another_tenants_namespace(acl_redis, procs):
    """Tenant B's producer user can neither read, cancel nor enqueue in tenant A's namespace;
    tenant A's own producer works; and a worker pointed at the wrong namespace stops at once
    with exit code 78 (an ACL denial is a permanent configuration error, contract 2)."""
    srv, users_a, users_b = acl_redis
    keys_a = Keys(NS_A, "q")
    procs.worker(users_a["worker"].url(srv.port), NS_A, "wa").wait_for_log("worker ready", 120)
    client_a = sdk_client(users_a["producer"].url(srv.port), NS_A)
    try:
        client_a.submit("tenant a secret", max_tokens=8, temperature=0.0, job_id="a1").result(timeout=60)
    finally:
        client_a.close()
    rb = srv.client(users_b["producer"])
    for attempt in (lambda: rb.xrange(keys_a.results("a1")),
                    lambda: rb.xread({keys_a.results("a1"): "0-0"}),
                    lambda: rb.get(keys_a.dedupe("a1")),
                    lambda: rb.set(keys_a.cancel("a1"), b"1"),
                    lambda: rb.xadd(keys_a.lane("default"), {PAYLOAD_FIELD: b"x"}),
                    lambda: rb.keys("*"),
                    lambda: rb.scan(0)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    client_b_in_a = sdk_client(users_b["producer"].url(srv.port), NS_A)
    try:
        with pytest.raises(Exception, match="(?i)noperm|permission"):
            client_b_in_a.submit("intruder", max_tokens=8, temperature=0.0, job_id="b-in-a")
    finally:
        client_b_in_a.close()
    assert not srv.client().exists(keys_a.dedupe("b-in-a"))
    client_b = sdk_client(users_b["producer"].url(srv.port), NS_B)
    try:
        client_b.submit("tenant b", max_tokens=8, temperature=0.0, job_id="b1")     # its own namespace works
    finally:
        client_b.close()
    assert srv.client().exists(Keys(NS_B, "q").dedupe("b1"))
    srv.client().acl_log_reset()
    wrong = procs.worker(users_b["worker"].url(srv.port), NS_A, "wb-in-a")
    assert_config_exit(wrong, "noperm", "permission", "acl")


def test_wrong_password_ends_the_worker_with_78_and_health_says_why(acl_redis, procs):
    srv, users, _ = acl_redis
    bad = User(users["worker"].name, "not-the-password")
    wp = procs.worker(bad.url(srv.port), NS_A, "wbad")
    assert_config_exit(wp, "wrongpass", "password", "auth")
    health = procs.run("tokenrelay", "health", "--redis-url", bad.url(srv.port),
                       "--namespace", NS_A, "--queue", "q", "--worker-id", "wbad")
    assert health.returncode != 0
    assert any(w in (health.stdout + health.stderr).lower()
               for w in ("wrongpass", "password", "auth")), health.stdout + health.stderr


# --------------------------------------------------------------------------------------------
# TLS
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Certs:
    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    other_ca: Path          # a CA that signed nothing here: verification against it fails


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=tokenrelay test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def _make_leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
             "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def make_certs(d: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate it signed,
    plus an unrelated CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed: cannot generate test certificates")
    d.mkdir(parents=True, exist_ok=True)
    ca = _make_ca(d, "ca")
    other = _make_ca(d, "other-ca")
    server = _make_leaf(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                         "extendedKeyUsage=serverAuth")
    client = _make_leaf(d, "client", ca, "extendedKeyUsage=clientAuth")
    return Certs(ca[0], server[0], server[1], client[0], client[1], other[0])


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[SecureRedis]:
    """redis-server with TLS only (``--port 0``), client certificates required, and the ACL
    users of tenant A (TLS and ACLs are used together in production)."""
    certs = make_certs(tmp_path / "certs")
    users = role_users(NS_A, "-a")
    aclfile = write_acl_file(tmp_path / "users.acl", {
        u.name: acl_rule(role, NS_A, u.password) for role, u in users.items()})
    srv = SecureRedis(tmp_path / "redis", [
        "--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes",
        "--aclfile", str(aclfile)], tls=certs)
    try:
        srv.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower() or "ssl" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS support: {exc}")
        raise
    try:
        yield srv
    finally:
        report_denials(srv)
        srv.kill()


def _tls_query(certs: Certs, ca: Optional[Path]) -> str:
    q = f"ssl_certfile={certs.client}&ssl_keyfile={certs.client_key}"
    return q + (f"&ssl_ca_certs={ca}" if ca is not None else "")


def test_tls_worker_and_sdk_with_ssl_ca_certs_and_ssl_cert_file(tls_redis, procs):
    """rediss:// with ?ssl_ca_certs= (worker and SDK) and with SSL_CERT_FILE (a second worker);
    the server requires client certificates, given as ?ssl_certfile=&ssl_keyfile=."""
    srv, certs = tls_redis, tls_redis.tls
    users = role_users(NS_A, "-a")
    w_url = users["worker"].url(srv.port, "rediss", _tls_query(certs, certs.ca))
    procs.worker(w_url, NS_A, "tls1").wait_for_log("worker ready", 120)
    env_url = users["worker"].url(srv.port, "rediss", _tls_query(certs, None))
    procs.worker(env_url, NS_A, "tls2", env={"SSL_CERT_FILE": str(certs.ca)}
                 ).wait_for_log("worker ready", 120)
    client = sdk_client(users["producer"].url(srv.port, "rediss", _tls_query(certs, certs.ca)),
                        NS_A)
    try:
        jobs = [client.submit(f"tls prompt {i}", max_tokens=8, temperature=0.0, job_id=f"t{i}") for i in range(6)]
        assert "".join(d.text for d in jobs[0].stream(timeout=60)) == \
            fake_completion("tls prompt 0", 8)
        for i, job in enumerate(jobs):
            assert job.result(timeout=60).text == fake_completion(f"tls prompt {i}", 8)
    finally:
        client.close()
    served = {json.loads(line).get("worker_id") for wp in procs.workers
              for line in wp.log().splitlines() if '"acked"' in line}
    assert served, "no worker acknowledged a job"
    with pytest.raises(redis.ConnectionError):  # without a client certificate: refused
        redis.Redis(host="127.0.0.1", port=srv.port, ssl=True, ssl_ca_certs=str(certs.ca),
                    username=users["producer"].name, password=users["producer"].password,
                    socket_timeout=5).ping()
    assert srv.denials() == []


def test_tls_wrong_ca_ends_the_worker_with_78(tls_redis, procs):
    srv, certs = tls_redis, tls_redis.tls
    url = role_users(NS_A, "-a")["worker"].url(srv.port, "rediss",
                                               _tls_query(certs, certs.other_ca))
    wp = procs.worker(url, NS_A, "tls-wrong-ca")
    assert_config_exit(wp, "certificate", "tls", "ssl", "verif")
