"""``python -m benchmarks.affinity``: what prefix-affinity routing buys a multi-turn chat.

Two ``tokenrelay worker`` processes on the bench-size tiny checkpoint (CPU, float32), a private
redis-server, and 32 conversations of 6 turns sharing one system prompt, run in two modes each
round: with a routing key per conversation (each turn goes to the worker whose prefix cache
holds the turns before it) and without (each turn goes to whichever worker reads the shared
lane first).

A conversation's turn k is the previous turn's prompt, its output token ids and a new user
message, as token ids (so a turn's prompt starts with exactly the tokens the previous turn's
KV blocks hold); outputs run greedy with ``ignore_eos`` for a length drawn per turn, and each
conversation thinks a random moment between turns, so turns do not arrive in lockstep. All
conversations finish turn 1 first (it fills both caches with the system prompt), then turns
2-6 run freely. Printed per mode: the prefix-cache hit rate of turns 2-6 (hit tokens / prompt
tokens looked up, from the workers' metrics), the time to first token (submit to the first
streamed token, at the client) of turn 1 and of turns 2-6 (mean, p50, p90, the mean part
spent before the worker admitted the job: ``queued``, and the mean as the worker times it,
enqueue to first token without the delivery to this process: ``at worker``), how often a
turn ran on the worker of the turn before it, and the wall time; then the two targets: hit rate with affinity >= 0.9,
TTFT of turns 2-6 at least 2x better with affinity, as medians over the rounds (the modes'
order alternates, so a shared host's drift hits both). Every mode uses the same lengths and
think times but fresh token ids, so none reads another's cache. Also printed: the mean engine
step (prefill work the cache saves also slows every other sequence's decode) and, without
keys, the TTFT of turns that landed on their previous turn's worker vs the other one. Not a
test: about two minutes a round on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import redis

from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tokenrelay.protocol.wire import decode_event
from benchmarks.worker import REPO, ensure_model
from devtools.redis_server import RedisServer, free_port

# The default beat: its hash lives 5 beats, longer than the longest step here (a burst of
# prefills on a loaded CPU takes a second or two; a worker whose hash expires counts as dead).
BEAT_MS = 1000
METRICS = ("tokenrelay_prefix_cache_queries_total", "tokenrelay_prefix_cache_hits_total",
           "tokenrelay_engine_step_seconds_sum", "tokenrelay_engine_step_seconds_count")


@dataclass
class Turn:
    user: list[int]          # the new user message's token ids
    max_tokens: int
    think_s: float           # pause before sending it


@dataclass
class Conversation:
    key: str
    turns: list[Turn]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    worker: str
    queued_s: float = 0.0    # enqueue to admission into the engine (the worker's timings)
    worker_ttft_s: float = 0.0   # enqueue to first token, at the worker (no delivery to us)


@dataclass
class ModeResult:
    name: str
    turns: list[TurnResult] = field(default_factory=list)
    hit_rate: float = 0.0
    wall_s: float = 0.0
    step_ms: float = 0.0     # mean engine step, both workers

    def ttft_by_home(self) -> tuple[list[float], list[float]]:
        """TTFT of later turns on the previous turn's worker, and on the other one."""
        by = {(t.conversation, t.turn): t for t in self.turns}
        same, moved = [], []
        for (c, k), t in by.items():
            if k > 0:
                (same if t.worker == by[(c, k - 1)].worker else moved).append(t.ttft_s)
        return same, moved

    def ttft(self, first: bool) -> list[float]:
        return [t.ttft_s for t in self.turns if (t.turn == 0) == first]

    def queued(self) -> list[float]:
        return [t.queued_s for t in self.turns if t.turn > 0]

    def worker_ttft(self) -> list[float]:
        return [t.worker_ttft_s for t in self.turns if t.turn > 0]

    def same_worker_share(self) -> float:
        by = {(t.conversation, t.turn): t.worker for t in self.turns}
        later = [(c, k) for c, k in by if k > 0]
        return sum(by[(c, k)] == by[(c, k - 1)] for c, k in later) / max(1, len(later))


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[Conversation]]:
    """The system prompt and the conversations: lengths and think times from ``--seed``."""
    rng = random.Random(args.seed)
    system = [rng.randrange(5, vocab) for _ in range(args.system_tokens)]
    lo, hi = args.output_tokens
    convs = [Conversation(f"conv-{c}", [
        Turn([rng.randrange(5, vocab) for _ in range(args.user_tokens)], rng.randint(lo, hi),
             rng.expovariate(1.0 / args.think_s) if args.think_s > 0 else 0.0)
        for _ in range(args.turns)]) for c in range(args.conversations)]
    return system, convs


def fresh_ids(system: list[int], convs: list[Conversation], vocab: int,
              salt: int) -> tuple[list[int], list[Conversation]]:
    """The same workload with other token ids (same lengths, same think times)."""
    def shift(ids: list[int]) -> list[int]:
        return [5 + (t - 5 + 7919 * salt) % (vocab - 5) for t in ids]
    return shift(system), [Conversation(c.key, [Turn(shift(t.user), t.max_tokens, t.think_s)
                                                for t in c.turns]) for c in convs]


# ------------------------------------------------------------------------------------------
# the fleet
# ------------------------------------------------------------------------------------------

class Fleet:
    """A private redis-server and ``tokenrelay worker`` processes with their metrics ports."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        self.srv = RedisServer(args=["--appendonly", "no"]).start()
        self.r = redis.Redis.from_url(self.srv.url)
        self._tmp = tempfile.TemporaryDirectory()
        self.ports: dict[str, int] = {}
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        flags = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs",
                 str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                 "--num-kv-blocks", str(args.num_kv_blocks), "--heartbeat-ms", str(BEAT_MS),
                 "--block-ms", "20", "--log-level", "warning", "--drain-timeout", "5"]
        if args.enforce_eager:
            flags.append("--enforce-eager")
        for i in range(args.workers):
            wid, port = f"bench-{i}", free_port()
            self.ports[wid] = port
            log = open(Path(self._tmp.name) / f"{wid}.log", "wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenrelay.worker", "--model", model, "--redis-url", self.srv.url,
                 "--worker-id", wid, "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                 *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = Keys()
        while True:
            ready = [self.r.hget(keys.heartbeat(w), "engine_loaded") == b"1" for w in self.ports]
            if all(ready):
                return
            dead = [p.args[p.args.index("--worker-id") + 1] for p in self.procs
                    if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready (exited: {dead}); logs in "
                                   f"{self._tmp.name}:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in Path(self._tmp.name).glob("*.log"))

    def counters(self) -> list[float]:
        """``METRICS`` summed over the workers: prompt tokens looked up in the prefix cache and
        hit, engine step seconds and steps."""
        total = [0.0] * len(METRICS)
        for port in self.ports.values():
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=10).read().decode()
            for line in body.splitlines():
                for i, name in enumerate(METRICS):
                    if line.startswith(name):
                        total[i] += float(line.split()[-1])
        return total

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.r.close()
        self.srv.stop()
        self._tmp.cleanup()


# ------------------------------------------------------------------------------------------
# one mode
# ------------------------------------------------------------------------------------------

async def run_turn(client: Any, conv: int, turn: int, prompt: list[int], t: Turn,
                   key: Optional[str], timeout: float) -> tuple[TurnResult, list[int]]:
    """Send one turn, time its first streamed token, return it with the output token ids."""
    t0 = time.perf_counter()
    job = await client.submit(prompt_token_ids=prompt, routing_key=key, max_tokens=t.max_tokens,
                              temperature=0, ignore_eos=True)
    ttft: Optional[float] = None
    async for _ in job.stream(timeout=timeout):
        if ttft is None:
            ttft = time.perf_counter() - t0
    result = await job.result(timeout=timeout)
    tm = result.timings
    return TurnResult(conv, turn, ttft or 0.0, await started_by(client, job.id),
                      (tm.queued_ms or 0.0) / 1000.0, (tm.ttft_ms or 0.0) / 1000.0), list(
        result.outputs[0].token_ids)


async def started_by(client: Any, job_id: str) -> str:
    """The worker of a job's first ``started`` event (its stream's first entry)."""
    ((_, fields),) = await client.redis.xrange(client.keys.results(job_id), count=1)
    return decode_event(fields[EVENT_FIELD]).worker_id


async def run_mode(url: str, fleet: Fleet, name: str, system: list[int],
                   convs: list[Conversation], use_keys: bool, timeout: float) -> ModeResult:
    from tokenrelay.producer_sdk import AsyncClient
    out = ModeResult(name)
    prompts = [list(system) for _ in convs]
    async with AsyncClient(url) as client:
        async def turn(c: int, k: int) -> None:
            t = convs[c].turns[k]
            prompt = prompts[c] + t.user
            res, ids = await run_turn(client, c, k, prompt, t,
                                      convs[c].key if use_keys else None, timeout)
            prompts[c] = prompt + ids
            out.turns.append(res)

        async def rest(c: int) -> None:
            for k in range(1, len(convs[c].turns)):
                await asyncio.sleep(convs[c].turns[k].think_s)
                await turn(c, k)

        await asyncio.gather(*(turn(c, 0) for c in range(len(convs))))
        await asyncio.sleep(2.5 * BEAT_MS / 1000)    # workers publish their counters each beat
        before = fleet.counters()
        t0 = time.perf_counter()
        await asyncio.gather(*(rest(c) for c in range(len(convs))))
        out.wall_s = time.perf_counter() - t0
        await asyncio.sleep(2.5 * BEAT_MS / 1000)
        queries, hits, step_s, steps = (b - a for a, b in zip(before, fleet.counters()))
    out.hit_rate = hits / max(1.0, queries)
    out.step_ms = 1000.0 * step_s / max(1.0, steps)
    return out


def header(args: argparse.Namespace, model: str) -> None:
    print(f"{args.workers} workers, {args.conversations} conversations x {args.turns} turns; "
          f"system prompt {args.system_tokens} tokens, user turns {args.user_tokens}, outputs "
          f"{args.output_tokens[0]}-{args.output_tokens[1]}; model {model}")
    print(f"{'round':<6}{'routing':<9}{'hit rate t2+':>13}{'TTFT t1 ms':>12}{'TTFT t2+ ms':>13}"
          f"{'p50':>8}{'p90':>8}{'queued':>8}{'at worker':>10}{'same worker':>12}"
          f"{'step ms':>9}{'wall s':>8}",
          flush=True)


def row(rnd: int, m: ModeResult) -> None:
    mean = statistics.mean
    later = sorted(m.ttft(False))
    same, moved = m.ttft_by_home()
    split = (f"  (previous turn's worker {mean(same) * 1e3:.0f} ms x{len(same)}, the other "
             f"{mean(moved) * 1e3:.0f} ms x{len(moved)})" if same and moved else "")
    print(f"{rnd:<6}{m.name:<9}{m.hit_rate:>13.3f}{mean(m.ttft(True)) * 1e3:>12.1f}"
          f"{mean(later) * 1e3:>13.1f}{later[len(later) // 2] * 1e3:>8.1f}"
          f"{later[int(len(later) * 0.9)] * 1e3:>8.1f}{mean(m.queued()) * 1e3:>8.1f}"
          f"{mean(m.worker_ttft()) * 1e3:>10.1f}{m.same_worker_share():>12.2f}"
          f"{m.step_ms:>9.1f}{m.wall_s:>8.1f}{split}", flush=True)


def summary(rounds: list[dict[str, ModeResult]], turns: int) -> None:
    """Medians over rounds of the two targets."""
    med, mean = statistics.median, statistics.mean
    ratios = [mean(r["no key"].ttft(False)) / mean(r["key"].ttft(False)) for r in rounds]
    at_worker = [mean(r["no key"].worker_ttft()) / mean(r["key"].worker_ttft()) for r in rounds]
    hits = [r["key"].hit_rate for r in rounds]
    print(f"with routing keys: prefix-cache hit rate of turns 2-{turns} {med(hits):.3f} "
          f"(target >= 0.9); mean TTFT of turns 2-{turns} {med(ratios):.2f}x better than "
          f"without (target >= 2x; {med(at_worker):.2f}x as the workers time it); medians of "
          f"{len(rounds)} rounds: ratios {', '.join(f'{x:.2f}' for x in ratios)}")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.affinity",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint (default: build the bench-size tiny one)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    p.add_argument("--think-s", type=float, default=0.2, help="mean pause between turns")
    p.add_argument("--rounds", type=int, default=2, help="each runs both modes (the order "
                   "alternates, so a shared host's drift hits both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true", help="no compiled kernels: quicker "
                   "start, slower steps")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    model = ensure_model(args.model)
    from tokenrelay.engine.model_config import ModelConfig
    vocab = ModelConfig.from_pretrained(model).vocab_size
    system, convs = make_workload(args, vocab)
    fleet = Fleet(model, args)
    rounds: list[dict[str, ModeResult]] = []
    try:
        fleet.wait_ready(args.timeout)
        # warm-up: every worker compiles and runs a step before anything is timed
        _, warm = fresh_ids(system[:16], convs[:2 * args.workers], vocab, 99)
        asyncio.run(run_mode(fleet.srv.url, fleet, "warm-up", system[:16],
                             [Conversation(c.key, c.turns[:1]) for c in warm], False,
                             args.timeout))
        header(args, model)
        salt = 0
        for rnd in range(1, args.rounds + 1):
            order = ["no key", "key"] if rnd % 2 else ["key", "no key"]
            done: dict[str, ModeResult] = {}
            for name in order:
                salt += 1              # fresh token ids: no mode reads another's cache
                s_ids, c_ids = fresh_ids(system, convs, vocab, salt)
                done[name] = asyncio.run(run_mode(fleet.srv.url, fleet, name, s_ids, c_ids,
                                                  name == "key", args.timeout))
                row(rnd, done[name])
            rounds.append(done)
    finally:
        fleet.close()
    summary(rounds, args.turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
