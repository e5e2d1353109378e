"""``--model fake:``: an engine with the step API of docs/contracts.md and no model.

Why it exists: producers test their own code against a real worker without a GPU or a
checkpoint, and the worker's promises (fencing, cancel within a step, resume, drain, priority)
are about Redis and the loop, not about the model, so their tests run in milliseconds. Output is a pure function of (prompt,
seed, output position), like the real engine's sampling contract, so a resumed request
continues exactly and tests can predict every token.

Tokens are characters: token id = ``ord(char)``; outputs are lowercase letters. The tokenizer
decodes an id to its character (``FakeTokenizer``), so logprobs' token texts are testable too.
``logit_bias`` is validated as the real engine validates it (ids within the "vocabulary", every
code point) but steers nothing: the output stays the pure function above.

Choices: with ``n > 1`` choice i draws its tokens from (prompt, seed, i, position) -- greedy
choices are identical, as a real engine's are -- one delta per running choice per step, and a
resumed request continues each choice from its own ResumeState (a finished one is not run).
Beam search (``beam_width = k``) takes ``max_tokens`` steps with no output, then returns k
fake beams of ``max_tokens`` tokens in one step, best first (``fake_beams``); it is a function
of the prompt only, so a rerun returns the same beams.

Structured outputs (``params.structured_outputs``) are honoured: each choice (and beam) walks
the constraint's grammar deterministically (``worker/fake_structured.py`` says how), ending
``stop`` with EOS (id 0, no text) as soon as the answer is complete; ``fake_constrained``
predicts it. Tools: the chat template is visible text (``render_chat``) that lists the tools'
names; ``tool_format`` (``fake:tools=none``) says whether the "template" renders tools, as a
real worker advertises it.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.outputs import RequestDelta, RequestError, ResumeState
from tokenrelay.engine.prompts import check_tools
from tokenrelay.engine.request_checks import check_logit_bias
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.protocol.tools import HERMES
from tokenrelay.worker.fake_structured import EOS, FakeConstraint


# Token ids are characters, so the "vocabulary" is every Unicode code point.
FAKE_VOCAB_SIZE = 0x110000


class FakeTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Each id's character; EOS (0) is nothing, or ``</s>`` kept as a special token."""
        return "".join(chr(i) if i > 0 else ("" if skip_special_tokens else "</s>")
                       for i in ids)


@dataclass
class _Choice:
    out_ids: list[int] = field(default_factory=list)
    finished: bool = False
    constraint: Optional[FakeConstraint] = None     # with params.structured_outputs


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    seed: int
    choices: list[_Choice] = field(default_factory=list)
    beam_steps: int = 0                 # beam search: steps searched so far


def fake_hash(prompt_ids: list[int], seed: int, position: int, greedy: bool,
              choice: int = 0) -> int:
    """The hash every fake pick at ``position`` draws from: of the prompt, the seed and
    choice (when sampling) and the position. Choice 0 hashes as before choices existed."""
    key = (sum(prompt_ids), len(prompt_ids), position, None if greedy else seed)
    if choice and not greedy:
        key += (choice,)
    h = hashlib.blake2b(repr(key).encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little")


def fake_token(prompt_ids: list[int], seed: int, position: int, greedy: bool,
               choice: int = 0) -> int:
    """The token at ``position`` of ``choice`` of an unconstrained request: a lowercase
    letter drawn by ``fake_hash``."""
    return 97 + fake_hash(prompt_ids, seed, position, greedy, choice) % 26


def fake_logprobs(token: int, top: int) -> dict[int, float]:
    """FakeEngine's logprobs at a position whose sampled token is ``token``, for
    ``params.logprobs = top``: the token (-0.5, always the best) and the letters after it
    (-1.5, -2.5, ...), ``top`` entries in all -- as the engine's top-N plus the chosen."""
    out = {token: -0.5}
    for j in range(1, top):
        out[97 + (token - 97 + j) % 26] = -0.5 - j
    return out


def fake_completion(prompt: str, max_tokens: int, seed: int = 0, greedy: bool = True,
                    choice: int = 0) -> str:
    """What FakeEngine generates for ``prompt`` (length-limited, no stops): for assertions."""
    ids = [ord(c) for c in prompt]
    return "".join(chr(fake_token(ids, seed, i, greedy, choice)) for i in range(max_tokens))


def fake_constrained(prompt: str, structured_outputs: Any, max_tokens: int, seed: int = 0,
                     greedy: bool = True, choice: int = 0) -> tuple[str, str]:
    """What FakeEngine answers for ``prompt`` under a constraint (a ``structured_outputs``
    map or StructuredOutputsParams): (text, finish_reason), for assertions."""
    from tokenrelay.protocol.structured_outputs import StructuredOutputsParams
    spec = StructuredOutputsParams.model_validate(structured_outputs)
    ids = [ord(c) for c in prompt]
    out = _walk(FakeConstraint.compile(spec), lambda i: fake_hash(ids, seed, i, greedy, choice),
                max_tokens)
    return "".join(chr(t) for t in out if t != EOS), "stop" if out[-1:] == [EOS] else "length"


def _walk(constraint: FakeConstraint, hash_at: Callable[[int], int], max_tokens: int,
          start: int = 0) -> list[int]:
    """The constrained tokens from position ``start`` until EOS (included) or ``max_tokens``."""
    out: list[int] = []
    for position in range(start, max_tokens):
        out.append(constraint.next_token(hash_at(position)))
        if out[-1] == EOS:
            break
    return out


def fake_beam(prompt_ids: list[int], max_tokens: int, rank: int) -> list[int]:
    """The beam of rank ``rank`` (0 = best) that FakeEngine's beam search returns."""
    h = [hashlib.blake2b(repr((sum(prompt_ids), len(prompt_ids), "beam", rank, i)).encode(),
                         digest_size=4).digest() for i in range(max_tokens)]
    return [97 + int.from_bytes(d, "little") % 26 for d in h]


def fake_beams(prompt: str, max_tokens: int, beam_width: int) -> list[str]:
    """FakeEngine's beams for ``prompt``, best first: for assertions."""
    ids = [ord(c) for c in prompt]
    return ["".join(map(chr, fake_beam(ids, max_tokens, r))) for r in range(beam_width)]


def fake_beam_logprob(max_tokens: int, rank: int) -> float:
    """The cumulative logprob FakeEngine gives the beam of ``rank``: lower for a worse rank."""
    return -0.5 * max_tokens - rank


class FakeEngine:
    """Contract-shaped engine: one token per scheduled request per step, lowest priority value
    (then arrival) first, at most ``max_num_seqs`` scheduled per step."""

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 4096, step_delay: float = 0.0,
                 fail_on: Optional[Callable[[list[str]], bool]] = None, max_n: int = 16,
                 max_beam_width: int = 16, tool_format: str = HERMES) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_n, self.max_beam_width = max_n, max_beam_width
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.fail_on = fail_on            # fail_on(scheduled ids) -> True makes step() raise
        self.tokenizer = FakeTokenizer()
        self.vocab_size = FAKE_VOCAB_SIZE
        self.tool_call_format = tool_format     # what the visible "template" does with tools
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self.num_steps = 0
        self.added: list[str] = []        # request ids in add order (tests inspect it)
        self.aborted: list[str] = []
        self.owners: dict[str, Optional[str]] = {}    # request id -> the owner it was added with

    # ------------------------------------------------------------------ contract
    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    priority: int = 0, resume: Optional[ResumeState] = None,
                    owner: Optional[str] = None) -> None:
        """The contract's add_request; ``owner`` is recorded (``owners``): the fake's walks
        compile inline, so there is no compile queue to share."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if params.n > self.max_n:
            raise InvalidRequestError(f"params.n: {params.n} is over max_n={self.max_n}")
        if (params.beam_width or 0) > self.max_beam_width:
            raise InvalidRequestError(f"params.beam_width: {params.beam_width} is over "
                                      f"max_beam_width={self.max_beam_width}")
        check_logit_bias(params, FAKE_VOCAB_SIZE)   # checked as the engine does; it steers nothing here
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}; together "
                f"they exceed max_model_len={self.max_model_len}")
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        req = _Request(request_id, ids, params, priority, next(self._arrivals), seed,
                       self._choices(params, resume))
        with self._lock:
            self._requests[request_id] = req
        self.added.append(request_id)
        self.owners[request_id] = owner

    @staticmethod
    def _choices(params: SamplingParams,
                 resume: Union[None, ResumeState, list[ResumeState]]) -> list[_Choice]:
        """Each choice's state, resumed as docs/contracts.md says (or InvalidRequestError);
        with a constraint, each running choice gets its matcher, resumed tokens replayed."""
        if params.use_beam_search:
            if resume is not None:
                raise InvalidRequestError("resume: beam search is rerun, never resumed")
            return [_Choice() for _ in range(params.beam_width or 1)]
        if resume is None:
            choices = [_Choice() for _ in range(params.n)]
        else:
            states = [resume] if isinstance(resume, ResumeState) else list(resume)
            if len(states) != params.n:
                raise InvalidRequestError(f"resume: {len(states)} ResumeStates for n={params.n}")
            choices = [_Choice(list(s.output_token_ids), s.finish_reason is not None)
                       for s in states]
            if all(c.finished for c in choices):
                raise InvalidRequestError("resume: every choice has already finished")
        spec = params.structured_outputs
        if spec is not None:
            for c in choices:
                if not c.finished:
                    c.constraint = FakeConstraint.compile(spec, c.out_ids)
        return choices

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
        return [d for r in scheduled for d in self._advance(r)]

    def _advance(self, r: _Request) -> list[RequestDelta]:
        deltas = (self._beam_step(r) if r.params.use_beam_search else
                  [self._sample(r, i, c) for i, c in enumerate(r.choices) if not c.finished])
        failed = [d for d in deltas if d.error is not None]
        if failed:                    # the request ends alone, with its one error delta
            deltas = failed[:1]
            for c in r.choices:
                c.finished = True
        if all(c.finished for c in r.choices):
            with self._lock:
                self._requests.pop(r.request_id, None)
        return deltas

    def _sample(self, r: _Request, index: int, c: _Choice) -> RequestDelta:
        args = (r.prompt_ids, r.seed, len(c.out_ids), r.params.greedy, index)
        if c.constraint is None:
            tok = fake_token(*args)
            stopped = tok in r.params.stop_token_ids
        else:
            try:
                tok = c.constraint.next_token(fake_hash(*args))
            except InvalidRequestError as exc:
                return RequestDelta(r.request_id, [], "", None, [], True, None, None,
                                    len(r.prompt_ids), len(c.out_ids), index=index,
                                    error=RequestError("invalid_request", str(exc)))
            stopped = tok == EOS
        c.out_ids.append(tok)
        c.finished = len(c.out_ids) >= r.params.max_tokens or stopped
        reason = None
        if c.finished:
            reason = "stop" if stopped else "length"
        lp = None if r.params.logprobs is None else [fake_logprobs(tok, r.params.logprobs)]
        stop_reason = tok if stopped and c.constraint is None else None
        return RequestDelta(r.request_id, [tok], self.tokenizer.decode([tok]), lp, [-0.5],
                            c.finished, reason, stop_reason, len(r.prompt_ids),
                            len(c.out_ids), index=index, cumulative_logprob=-0.5 * len(c.out_ids))

    def _beam_step(self, r: _Request) -> list[RequestDelta]:
        """Search silently for ``max_tokens`` steps, then every beam at once, best first."""
        r.beam_steps += 1
        if r.beam_steps < r.params.max_tokens:
            return []
        out = []
        for rank, c in enumerate(r.choices):
            c.out_ids, c.finished = self._beam(r, rank), True
            reason = "stop" if c.out_ids[-1:] == [EOS] else "length"
            out.append(RequestDelta(r.request_id, list(c.out_ids),
                                    self.tokenizer.decode(c.out_ids), None,
                                    [-0.5] * len(c.out_ids), True, reason, None,
                                    len(r.prompt_ids), len(c.out_ids), index=rank,
                                    cumulative_logprob=fake_beam_logprob(len(c.out_ids), rank)))
        return out

    @staticmethod
    def _beam(r: _Request, rank: int) -> list[int]:
        """The beam of ``rank``: ``fake_beam``, or under a constraint its walk for the rank."""
        spec = r.params.structured_outputs
        if spec is None:
            return fake_beam(r.prompt_ids, r.params.max_tokens, rank)
        ids = r.prompt_ids
        return _walk(FakeConstraint.compile(spec),
                     lambda i: fake_hash(ids + [rank], 0, i, False, rank), r.params.max_tokens)

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
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[list[dict]] = None) -> str:
        """A visible template: the tools' names (refused as a real template that ignores
        tools would be, under ``tool_format`` none), each message, then ``<assistant>``, then
        the variables given."""
        names = [t["function"]["name"] for t in check_tools(tools, self.tool_call_format)]
        text = f"<tools>{','.join(names)}</tools>\n" if names else ""
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        if chat_template_kwargs:
            text += "".join(f"<{k}={v!r}>" for k, v in sorted(chat_template_kwargs.items()))
        return text

    def stats(self) -> dict[str, Any]:
        n = len(self._requests)
        running = min(n, self.max_num_seqs)
        return {"num_preemptions": 0, "kv_blocks_total": 1000, "kv_blocks_used": running,
                "max_model_len": self.max_model_len,
                "kv_utilization_peak": 0.0, "prefix_cache_hit_rate": 0.0,
                "num_running": running, "num_waiting": n - running}
