"""``--model fake:``: an engine with the step API of docs/contracts.md and no model.

Why it exists: producers test their own code against a real worker without a GPU or a
checkpoint, and the worker's promises (fencing, cancel within a step, resume, drain, priority)
are about Redis and the loop, not about the model, so their tests run in milliseconds. Output is a pure function of (prompt,
seed, output position), like the real engine's sampling contract, so a resumed request
continues exactly and tests can predict every token.

Tokens are characters: token id = ``ord(char)``; outputs are lowercase letters.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.outputs import RequestDelta, ResumeState
from engine.sampling_params import SamplingParams


class FakeTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 0)


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    seed: int
    out_ids: list[int] = field(default_factory=list)


def fake_token(prompt_ids: list[int], seed: int, position: int, greedy: bool) -> int:
    """The token at ``position``: a function of the prompt, the seed (when sampling) and position."""
    h = hashlib.blake2b(repr((sum(prompt_ids), len(prompt_ids), position,
                              None if greedy else seed)).encode(), digest_size=4)
    return 97 + int.from_bytes(h.digest(), "little") % 26


def fake_completion(prompt: str, max_tokens: int, seed: int = 0, greedy: bool = True) -> str:
    """What FakeEngine generates for ``prompt`` (length-limited, no stops): for assertions."""
    ids = [ord(c) for c in prompt]
    return "".join(chr(fake_token(ids, seed, i, greedy)) for i in range(max_tokens))


class FakeEngine:
    """Contract-shaped engine: one token per scheduled request per step, lowest priority value
    (then arrival) first, at most ``max_num_seqs`` scheduled per step."""

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 4096, step_delay: float = 0.0,
                 fail_on: Optional[Callable[[list[str]], bool]] = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.fail_on = fail_on            # fail_on(scheduled ids) -> True makes step() raise
        self.tokenizer = FakeTokenizer()
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self.num_steps = 0
        self.added: list[str] = []        # request ids in add order (tests inspect it)
        self.aborted: list[str] = []

    # ------------------------------------------------------------------ contract
    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    priority: int = 0, resume: Optional[ResumeState] = None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}; together "
                f"they exceed max_model_len={self.max_model_len}")
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        req = _Request(request_id, ids, params, priority, next(self._arrivals), seed)
        if resume is not None:
            req.out_ids = list(resume.output_token_ids)
        with self._lock:
            self._requests[request_id] = req
        self.added.append(request_id)

    def request_seed(self, request_id: str) -> int:
        return self._requests[request_id].seed

    def step(self) -> list[RequestDelta]:
        with self._lock:
            order = sorted(self._requests.values(), key=lambda r: (r.priority, r.arrival))
            scheduled = order[: self.max_num_seqs]
        self.num_steps += 1
        if self.fail_on is not None and self.fail_on([r.request_id for r in scheduled]):
            raise RuntimeError("injected engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        return [self._advance(r) for r in scheduled]

    def _advance(self, r: _Request) -> RequestDelta:
        tok = fake_token(r.prompt_ids, r.seed, len(r.out_ids), r.params.greedy)
        r.out_ids.append(tok)
        finished = len(r.out_ids) >= r.params.max_tokens or tok in r.params.stop_token_ids
        reason = None
        if finished:
            reason = "stop" if tok in r.params.stop_token_ids else "length"
            with self._lock:
                self._requests.pop(r.request_id, None)
        lp = None if r.params.logprobs is None else [{tok: -0.5}]
        return RequestDelta(r.request_id, [tok], chr(tok), lp, [-0.5], finished, reason,
                         tok if reason == "stop" else None, len(r.prompt_ids), len(r.out_ids))

    def abort_request(self, request_id: str) -> bool:
        with self._lock:
            found = self._requests.pop(request_id, None) is not None
        if found:
            self.aborted.append(request_id)
        return found

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def free_capacity(self) -> int:
        return max(0, self.max_num_seqs - len(self._requests))

    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """A visible template: each message, then ``<assistant>``, then the variables given."""
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        if chat_template_kwargs:
            text += "".join(f"<{k}={v!r}>" for k, v in sorted(chat_template_kwargs.items()))
        return text

    def stats(self) -> dict[str, Any]:
        n = len(self._requests)
        running = min(n, self.max_num_seqs)
        return {"num_preemptions": 0, "kv_blocks_total": 1000, "kv_blocks_used": running,
                "kv_utilization_peak": 0.0, "prefix_cache_hit_rate": 0.0,
                "num_running": running, "num_waiting": n - running}
