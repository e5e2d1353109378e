"""Test support for the worker and fault tests: the one ``wait_for``, test-only fault injection
(``TOKENRELAY_FAULT_INJECT``, and ``TOKENRELAY_FAULT_POINT``: a SIGKILL at a point of a flush;
both applied by tests/fault_worker.py), raw producer helpers, result
streams as a client sees them, and ``FaultEnv`` (a redis-server plus worker processes, all killed
at teardown, also when the test failed). Servers and worker processes come from
tests/fixtures_redis.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import redis

REDIS_7 = "/usr/bin/redis-server"
REDIS_62 = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "redis-server")


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a child's whole process group; quiet if it is already gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM a child's process group, SIGKILL it if it has not exited within ``timeout``."""
    if proc.poll() is not None:
        return
    kill_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------------------------
# fault injection (test-only: workers started by tests run tests/fault_worker.py, which wraps
# the engine factory with this; the production path never reads the variable)
# --------------------------------------------------------------------------------------------

FAULT_INJECT_ENV = "TOKENRELAY_FAULT_INJECT"


class InjectedEngineFault(RuntimeError):
    """What an engine step raises under fault injection. ``request_ids`` names the requests
    that caused it, as a real engine error may; the worker hands those back counting a delivery."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"injected engine failure for {request_ids}")
        self.request_ids = list(request_ids)


class FaultInjectingEngine:
    """Wraps any engine; ``step()`` raises while a request whose prompt contains the marker is
    unfinished. Enabled only by ``TOKENRELAY_FAULT_INJECT="raise_on_prompt:<marker>"``: it lets
    a test make one prompt kill every worker that runs it (poison) in a real worker process."""

    def __init__(self, engine: Any, marker: str) -> None:
        self._engine = engine
        self._marker = marker
        self._marked: set[str] = set()

    def add_request(self, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
        self._engine.add_request(request_id, prompt, *args, **kwargs)
        text = prompt if isinstance(prompt, str) else self._engine.tokenizer.decode(list(prompt))
        if self._marker in text:
            self._marked.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        self._marked.discard(request_id)
        return self._engine.abort_request(request_id)

    def step(self) -> Any:
        if self._marked:
            raise InjectedEngineFault(sorted(self._marked))
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def maybe_inject_faults(engine: Any, spec: Optional[str] = None) -> Any:
    """The engine, wrapped when ``TOKENRELAY_FAULT_INJECT`` (or ``spec``) asks for it."""
    spec = os.environ.get(FAULT_INJECT_ENV, "") if spec is None else spec
    if not spec:
        return engine
    kind, _, arg = spec.partition(":")
    if kind != "raise_on_prompt" or not arg:
        raise ValueError(f"{FAULT_INJECT_ENV}={spec!r}: expected 'raise_on_prompt:<marker>'")
    return FaultInjectingEngine(engine, arg)


FAULT_POINT_ENV = "TOKENRELAY_FAULT_POINT"


def kill_at(point: str, nth: int) -> Callable[[str], None]:
    """An outbox fault point (worker/outbox.py, FAULT_POINTS) that SIGKILLs the worker the
    ``nth`` time its flush reaches ``point``: a kill at an exact point of the pipeline, with
    no timing involved. It says so on stderr first (the test checks the line)."""
    from tokenrelay.worker.outbox import FAULT_POINTS
    if point not in FAULT_POINTS or nth < 1:
        raise ValueError(f"{FAULT_POINT_ENV}: expected '<{'|'.join(FAULT_POINTS)}>:<n >= 1>', "
                         f"got {point!r}:{nth}")
    seen = [0]

    def hook(reached: str) -> None:
        if reached != point:
            return
        seen[0] += 1
        if seen[0] == nth:
            sys.stderr.write(f"fault point {point} #{nth} reached: SIGKILL\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def fault_point_from_env(spec: Optional[str] = None) -> Optional[Callable[[str], None]]:
    """``kill_at`` from ``TOKENRELAY_FAULT_POINT="<point>:<n>"`` (or ``spec``); None unset."""
    spec = os.environ.get(FAULT_POINT_ENV, "") if spec is None else spec
    if not spec:
        return None
    point, _, nth = spec.partition(":")
    return kill_at(point, int(nth or 1))


# --------------------------------------------------------------------------------------------
# producer-side helpers for raw entries (the real producer SDK lives in producer_sdk/)
# --------------------------------------------------------------------------------------------

def submit(client: Any, keys: Any, job: Any, raw: Optional[bytes] = None,
           lane: Optional[str] = None) -> str:
    """XADD a job (JobRequest, dict, or ``raw`` payload bytes) onto its priority lane, as a raw
    producer does: no dedupe record (the worker binds the job id to the entry)."""
    from tokenrelay.protocol.keys import PAYLOAD_FIELD
    from tokenrelay.protocol.wire import JobRequest, encode_job
    if raw is None:
        job = job if isinstance(job, JobRequest) else JobRequest.model_validate(job)
        raw = encode_job(job)
        lane = lane or keys.lane_for_priority(job.priority)
    entry_id = client.xadd(keys.lane(lane or "default"), {PAYLOAD_FIELD: raw})
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def enqueue(client: Any, keys: Any, job: Any, dedupe_ttl_s: int = 86_400) -> tuple[str, str]:
    """Enqueue a job (JobRequest or dict) as the SDK's enqueue script does: XADD onto its
    priority lane of the shard its job id maps to (``keys.shard_of``), and the job's dedupe
    record in that shard, naming the entry. Works on a plain client and on a cluster client
    (both keys share the shard's slot). Returns (lane key, entry id)."""
    from tokenrelay.protocol.keys import PAYLOAD_FIELD, dedupe_record
    from tokenrelay.protocol.wire import JobRequest, encode_job
    job = job if isinstance(job, JobRequest) else JobRequest.model_validate(job)
    shard = keys.shard_of(job.job_id)
    lane = keys.jobs_stream(job.priority, shard)
    entry_id = client.xadd(lane, {PAYLOAD_FIELD: encode_job(job)})
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    client.set(keys.dedupe(job.job_id, shard), dedupe_record(lane, entry_id), ex=dedupe_ttl_s)
    return lane, entry_id


def ids_on_shard(keys: Any, shard: int, prefix: str, n: int) -> list[str]:
    """``n`` job ids (``<prefix>-<i>``) that a producer puts on ``shard``."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        if keys.shard_of(f"{prefix}-{i}") == shard:
            out.append(f"{prefix}-{i}")
        i += 1
    return out


def read_events(client: Any, keys: Any, job_id: str) -> list:
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    return [decode_event(f[EVENT_FIELD]) for _, f in client.xrange(keys.results(job_id))]


def wait_for_terminal(client: Any, keys: Any, job_ids: Any, timeout: float = 20.0) -> dict:
    """Wait until every job has a terminal event; returns job_id -> events."""
    ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
    out: dict = {}

    def all_ended() -> bool:
        for jid in ids:
            if jid not in out:
                events = read_events(client, keys, jid)
                if events and events[-1].type in ("done", "error"):
                    out[jid] = events
        return len(out) == len(ids)
    wait_for(all_ended, timeout, interval=0.02,
             what=f"a terminal event of {[j for j in ids if j not in out][:5]}")
    return out


# --------------------------------------------------------------------------------------------
# result streams as a client sees them
# --------------------------------------------------------------------------------------------

@dataclass
class StreamReport:
    """One job's result stream, decoded, with every violation of "each token exactly once"."""

    job_id: str
    token_ids: list[int] = field(default_factory=list)   # choice 0 (all of an n == 1 job)
    text: str = ""
    choices: dict[int, "ChoiceReport"] = field(default_factory=dict)   # every choice by index
    terminal: Optional[object] = None          # the DoneEvent / ErrorEvent
    started: list[object] = field(default_factory=list)
    num_token_events: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.terminal is not None

    @property
    def kind(self) -> str:
        """``done:<finish_reason>``, ``error:<code>`` or ``open``."""
        t = self.terminal
        if t is None:
            return "open"
        return f"done:{t.finish_reason}" if t.type == "done" else f"error:{t.code}"


@dataclass
class ChoiceReport:
    """One choice of a result stream: its output and how its last token event ended it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    num_token_events: int = 0


def check_stream(r: redis.Redis, keys, job_id: str) -> StreamReport:
    """Decode a result stream and list every duplicate, gap, misplaced position, token after
    its choice finished, or extra terminal. Each choice is checked on its own: positions
    contiguous from 0 within it; seq is contiguous across the whole job."""
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    rep = StreamReport(job_id)
    for entry_id, fields in r.xrange(keys.results(job_id)):
        ev = decode_event(fields[EVENT_FIELD])
        if rep.terminal is not None:
            rep.problems.append(f"{ev.type} event after the terminal event")
            continue
        if ev.type == "started":
            rep.started.append(ev)
        elif ev.type == "token":
            _check_token(rep, ev)
        else:
            rep.terminal = ev
    t = rep.terminal
    if t is not None and t.type == "done" and t.text is not None:    # stream=False jobs
        rep.choices.setdefault(0, ChoiceReport())
        for c in t.choices or [t]:
            out = rep.choices.setdefault(getattr(c, "index", 0), ChoiceReport())
            out.text, out.token_ids = c.text or "", list(c.token_ids or [])
            out.finish_reason = c.finish_reason
    first = rep.choices.get(0, ChoiceReport())
    rep.text, rep.token_ids = first.text, first.token_ids
    return rep


def _check_token(rep: StreamReport, ev: Any) -> None:
    if ev.seq != rep.num_token_events:
        rep.problems.append(f"token seq {ev.seq}, expected {rep.num_token_events}")
    c = rep.choices.setdefault(ev.choice, ChoiceReport())
    if c.finish_reason is not None:
        rep.problems.append(f"choice {ev.choice}: token event after its finish_reason")
    if ev.position != len(c.token_ids):
        rep.problems.append(f"choice {ev.choice}: token position {ev.position}, expected "
                            f"{len(c.token_ids)}")
    rep.num_token_events += 1
    c.num_token_events += 1
    c.token_ids.extend(ev.token_ids)
    c.text += ev.text
    c.finish_reason = ev.finish_reason


def wait_all_ended(r: redis.Redis, keys, job_ids: Sequence[str], timeout: float,
                   procs: Sequence[object] = ()) -> dict[str, StreamReport]:
    """Poll until every job's stream ended; on timeout say which are still open."""
    deadline = time.monotonic() + timeout
    open_ids = list(job_ids)
    reports: dict[str, StreamReport] = {}
    while True:
        still = []
        for job_id in open_ids:
            rep = check_stream(r, keys, job_id)
            if rep.ended:
                reports[job_id] = rep
            else:
                still.append(job_id)
        open_ids = still
        if not open_ids:
            return reports
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(open_ids)} of {len(job_ids)} jobs never ended, e.g. "
                               f"{open_ids[:5]}; pending: {pending_summary(r, keys)}")
        time.sleep(0.1)


def queue_streams(r: redis.Redis, keys) -> list[str]:
    """Every stream where a queue's entries may wait: its lanes, and the affinity streams (every
    shard) of its registered workers (a killed worker stays registered)."""
    workers = sorted(w.decode() if isinstance(w, bytes) else str(w)
                     for w in r.zrange(keys.workers, 0, -1))
    return keys.lanes() + [keys.affinity(w, s) for w in workers for s in range(keys.shards)]


def pending_summary(r: redis.Redis, keys) -> list[tuple[str, str, int, int]]:
    """(entry id, consumer, idle ms, deliveries) of every pending entry (lanes and affinity
    streams), for failure messages."""
    out = []
    for lane in queue_streams(r, keys):
        try:
            rows = r.xpending_range(lane, "workers", min="-", max="+", count=1000)
        except redis.ResponseError:
            continue
        out.extend((row["message_id"].decode(), row["consumer"].decode(),
                    row["time_since_delivered"], row["times_delivered"]) for row in rows)
    return out


# --------------------------------------------------------------------------------------------
# a Redis + worker processes + producer environment for kill tests
# --------------------------------------------------------------------------------------------

# The contract-shaped FakeEngine (worker/fake_engine.py) behind the real service: process startup
# without torch, tokens a pure function of (prompt, seed, position), so resumes are checkable.
FAKE_MODEL = "fake:step_delay={delay}"
FAST_FLAGS = {"lease-ms": 1000, "max-deliveries": 3, "heartbeat-ms": 200, "block-ms": 100,
              "result-ttl": 120, "drain-timeout": 5, "device": "cpu", "log-level": "debug"}


class FaultEnv:
    """One test's world: a redis-server (or a Redis Cluster the caller owns), worker
    subprocesses, a producer client.

    Workers are ``tokenrelay worker`` children (tests/fixtures_redis.WorkerProcess, each in its
    own process group); ``close`` SIGKILLs every one of them and the server, whatever happened.
    ``shards`` > 1 runs the workers with ``--shards``; ``cluster`` (a started
    ``devtools.redis_server.RedisCluster``) replaces the private server: ``r`` is then a cluster
    client, and the cluster is left running (give each test its own namespace).
    """

    def __init__(self, tmp_path: Path, namespace: str = "ft", queue: str = "q",
                 redis_args: Sequence[str] = (), shards: int = 1, cluster: Any = None) -> None:
        from tokenrelay.protocol.keys import Keys
        from tokenrelay.protocol.topology import make_client
        from tests.fixtures_redis import start_redis_server
        self.tmp_path = tmp_path
        self.keys = Keys(namespace, queue, shards)
        self.cluster = cluster
        if cluster is None:
            self.redis = start_redis_server(tmp_path / "redis", *redis_args)
            self.url = self.redis.url
            self.r = self.redis.client(socket_timeout=10)
        else:
            self.redis, self.url = None, cluster.url
            self.r = make_client(cluster.url, True, socket_timeout=10)
        self.workers: list = []
        self._clients: list = []

    # -- workers
    def worker(self, worker_id: str, model: Optional[str] = None, delay: float = 0.02,
               env: Optional[dict[str, str]] = None, wait: bool = True, **flags: object):
        """Start ``tokenrelay worker``; ``flags`` override FAST_FLAGS (underscores -> dashes)."""
        from tests.fixtures_redis import WorkerProcess
        merged = {**FAST_FLAGS, **{k.replace("_", "-"): v for k, v in flags.items()}}
        args = ["--model", model or FAKE_MODEL.format(delay=delay), "--redis-url", self.url,
                "--namespace", self.keys.namespace, "--queue", self.keys.queue,
                "--worker-id", worker_id]
        if self.keys.shards > 1:
            args += ["--shards", str(self.keys.shards)]
        for k, v in merged.items():
            args += [f"--{k}", str(v)]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        wp = WorkerProcess(args=tuple(args), env=full_env,
                           log_path=self.tmp_path / f"{worker_id}-{len(self.workers)}.log")
        self.workers.append(wp)
        wp.start()
        if wait:
            wp.wait_for_log("worker ready", timeout=120)
        return wp

    def held_by(self, consumer: str) -> list[str]:
        """Entry ids pending under ``consumer``."""
        return [eid for eid, who, _, _ in pending_summary(self.r, self.keys) if who == consumer]

    # -- producer side
    def client(self, **settings: object):
        from tokenrelay.producer_sdk.client import Client
        c = Client(self.url, queue=self.keys.queue, namespace=self.keys.namespace,
                   **settings)
        self._clients.append(c)
        return c

    def submit(self, prompts: Sequence[str], prefix: str = "job", priority: int = 0,
               **sampling: object) -> list[str]:
        """Submit one job per prompt (ids ``<prefix>-<i>``); returns the job ids. A sharded
        queue or a cluster gets the jobs from ``enqueue`` (what the SDK's script writes)."""
        reqs = [{"prompt": p, "job_id": f"{prefix}-{i}"} for i, p in enumerate(prompts)]
        if self.keys.shards > 1 or self.cluster is not None:
            for req in reqs:
                enqueue(self.r, self.keys, {**req, "priority": priority, "params": sampling})
        else:
            client = self._clients[0] if self._clients else self.client()
            client.submit_many(reqs, priority=priority, **sampling)
        return [req["job_id"] for req in reqs]

    def streams(self, job_ids: Sequence[str]) -> dict[str, StreamReport]:
        return {j: check_stream(self.r, self.keys, j) for j in job_ids}

    def tokens_streamed(self, job_ids: Sequence[str]) -> int:
        return sum(len(rep.token_ids) for rep in self.streams(job_ids).values())

    def wait_ended(self, job_ids: Sequence[str], timeout: float) -> dict[str, StreamReport]:
        return wait_all_ended(self.r, self.keys, job_ids, timeout)

    def assert_exactly_once(self, reports: dict[str, StreamReport]) -> None:
        """Every stream: tokens contiguous from seq 0, each once, one terminal event, nothing
        left pending or waiting in any lane or registered worker's affinity stream."""
        bad = {j: rep.problems for j, rep in reports.items() if rep.problems}
        assert not bad, f"streams broken: {dict(list(bad.items())[:5])}"
        wait_for(lambda: not pending_summary(self.r, self.keys), 10,
                 what="every entry acknowledged")
        assert all(self.r.xlen(s) == 0 for s in queue_streams(self.r, self.keys)), \
            "acked jobs not deleted"

    def logs(self) -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.log()[-4000:]}" for w in self.workers)

    def close(self) -> None:
        for wp in self.workers:
            try:
                if wp.proc is not None and wp.proc.poll() is None:
                    os.killpg(wp.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            wp.kill()
        for c in self._clients:
            try:
                c.close()
            except Exception:  # teardown must go on
                pass
        self.r.close()
        if self.redis is not None:
            self.redis.kill()


class RepeatedKills:
    """A worker SIGKILLed ``after_ready_s`` after each start logged "worker ready", or at once
    when it died by itself, and started again: the soaks' fault. ``due()`` releases the soak's
    work in waves, one per kill, each once the new start is ready, so every wave meets a fresh
    worker mid-stream and the kills happen however fast the host runs the jobs (on a loaded
    host the other worker alone finished a whole soak before the third restart was ready)."""

    def __init__(self, harness: "FaultEnv", worker_id: str, after_ready_s: float = 1.0,
                 may_die: bool = False, **start: Any) -> None:
        """``start``: ``FaultEnv.worker``'s arguments, for every start."""
        self.env, self.worker_id, self.after_ready_s, self.start = (harness, worker_id,
                                                                    after_ready_s, start)
        self.may_die = may_die          # False: a worker that exits by itself fails the test
        self.worker = harness.worker(worker_id, **start)
        self.ready_at: Optional[float] = time.monotonic()
        self.kills = 0

    def tick(self) -> None:
        """Kill and restart when due; note the moment a restart says it is ready."""
        alive = self.worker.proc.poll() is None
        assert alive or self.may_die, (f"{self.worker_id} exited by itself "
                                       f"({self.worker.proc.returncode}):\n"
                                       f"{self.worker.log()[-3000:]}")
        if alive and self.ready_at is None and "worker ready" in self.worker.log():
            self.ready_at = time.monotonic()
        if not alive or (self.ready_at is not None
                         and time.monotonic() > self.ready_at + self.after_ready_s):
            self.worker.kill()                          # SIGKILL, whatever it was doing
            self.kills += 1
            self.worker = self.env.worker(self.worker_id, wait=False, **self.start)
            self.ready_at = None

    def due(self, wave: int) -> bool:
        """Whether wave ``wave`` (0 first) may go in: after ``wave`` kills, with the worker
        started since then ready."""
        return self.kills >= wave and self.ready_at is not None


# -- child processes and the takeover story (worker, tensor-parallel, engine-process tests) --

def child_pids(parent: int, module: bytes) -> list[int]:
    """Pids of ``parent``'s children whose command line names ``module``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module in cmdline:
            out.append(int(entry.name))
    return out


def log_events(log: str, prefix: str) -> list[dict]:
    """The JSON log lines whose event starts with ``prefix``."""
    import json
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event", "").startswith(prefix):
            out.append(rec)
    return out


def assert_resumed_like_offline(reports: dict, jobs: Sequence[str], offline: Sequence[Any],
                                held: Any, survivor: str) -> list:
    """Every job ended by length with exactly the offline engine's tokens and text, and the
    victim's jobs were resumed by ``survivor`` (some after tokens were delivered). Returns the
    resumed reports."""
    for job_id, out in zip(jobs, offline):
        rep = reports[job_id]
        assert rep.kind == "done:length"
        assert rep.token_ids == list(out.outputs[0].token_ids), job_id
        assert rep.text == out.outputs[0].text, job_id
    resumed = [r for r in reports.values() if len(r.started) > 1]
    assert held and resumed, "the victim held nothing when it failed: the test proved nothing"
    assert all(r.started[-1].worker_id == survivor for r in resumed)
    assert any(r.started[-1].resumed_tokens > 0 for r in resumed)
    return resumed
