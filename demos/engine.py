"""Engine demo: stream two prompts token by token through the step API, then print stats.

``python -m demos.engine [--model PATH] [--max-tokens N]``

Without ``--model`` a tiny random-weight Llama checkpoint is written to ``.models/tiny-llama``
(or a temporary folder when that is not writable): its text is gibberish, but every part of the
engine (paged KV cache, continuous batching, sampling, incremental detokenization) is real.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.sampling_params import SamplingParams

PROMPTS = {
    "A": "Once upon a time, in a village by the sea,",
    "B": "The three most important ideas in computer science are",
}
COLORS = {"A": "\x1b[36m", "B": "\x1b[33m"}
RESET = "\x1b[0m"


def default_model() -> str:
    from tokenrelay.engine.tiny import write_checkpoint

    target = Path(".models/tiny-llama")
    if (target / "config.json").is_file():
        return str(target)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        target = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    print(f"writing a tiny random-weight checkpoint to {target} ...", flush=True)
    return str(write_checkpoint(target, arch="llama"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demos.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Hugging Face checkpoint folder (default: a tiny one)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args(argv)

    model = args.model or default_model()
    engine = LLMEngine.from_kwargs(model=model, max_model_len=1024, num_kv_blocks=256)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=args.max_tokens,
                                                       temperature=args.temperature, seed=1))
    tty = sys.stdout.isatty()
    texts = {rid: "" for rid in PROMPTS}
    width = shutil.get_terminal_size((100, 20)).columns - 6
    start = time.perf_counter()
    if tty:
        print("\n" * (len(PROMPTS) - 1))
    while engine.has_unfinished_requests():
        deltas = engine.step()
        for d in deltas:
            texts[d.request_id] += d.new_text
            if not tty and d.new_text:
                print(f"[{d.request_id}] {d.new_text!r}", flush=True)
        if tty and deltas:
            # Redraw one line per request, in place, so both streams stay readable.
            sys.stdout.write(f"\x1b[{len(PROMPTS)}F")
            for rid, text in texts.items():
                shown = (PROMPTS[rid] + text).replace("\n", " ")[-width:]
                sys.stdout.write(f"\x1b[2K{COLORS[rid]}[{rid}]{RESET} {shown}\n")
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print()
    for rid, text in texts.items():
        print(f"[{rid}] {PROMPTS[rid]}{COLORS[rid] if tty else ''}{text}{RESET if tty else ''}")
    stats = engine.stats()
    print(f"\n{stats['num_generated_tokens']} tokens in {elapsed:.2f} s "
          f"({stats['num_generated_tokens'] / elapsed:.1f} tok/s)")
    for key in ("num_steps", "num_preemptions", "kv_blocks_total", "kv_blocks_used",
                "kv_blocks_peak", "kv_utilization_peak", "prefix_cache_hit_rate"):
        value = stats[key]
        print(f"  {key:24s} {value:.3f}" if isinstance(value, float) else f"  {key:24s} {value}")


if __name__ == "__main__":
    main()
