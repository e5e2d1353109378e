"""LLMEngine: the step API (add_request / step / abort_request) the worker drives.

One ``step()`` = schedule -> one forward pass -> sample -> detokenize -> finish checks. The
engine holds no threads and no queues of its own beyond the scheduler's; the caller decides
when to step. See docs/contracts.md for the contract this implements.
"""

from __future__ import annotations

import itertools
import numbers
import random
import time
from typing import Any, Callable, Mapping, Optional, Sequence as Seq, TypedDict, Union

import torch

from engine.beam_search import BeamSearch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, detokenize_step
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.forks import advance_beams, beam_deltas, branch_seed, fork_samples
from engine.model_runner import ModelRunner
from engine.outputs import RequestDelta, ResumeState
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceGroup
from protocol.wire import RESERVED_CHAT_TEMPLATE_KWARGS

class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-ids prompt dict."""

    prompt_token_ids: list[int]


# A prompt: text, token ids, or one of vLLM's prompt dicts.
PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def check_chat_template_kwargs(kwargs: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The template variables as a dict; InvalidRequestError for anything else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError("chat_template_kwargs: must be a dict with string keys")
    reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs: {reserved} are set by the engine, "
                                  f"not by the request")
    return dict(kwargs)


def prompt_of(prompt: Any) -> Union[str, list[int]]:
    """The text or token ids a prompt holds; a prompt dict must hold exactly one of
    ``prompt`` / ``prompt_token_ids`` and nothing this engine would silently ignore."""
    if not isinstance(prompt, Mapping):
        return prompt
    unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"prompt: unsupported prompt dict keys {unknown}; a prompt dict holds either "
            f"'prompt' (text) or 'prompt_token_ids' (token ids)")
    present = [k for k in _PROMPT_KEYS if k in prompt]
    if len(present) != 1:
        raise InvalidRequestError(
            "prompt: a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids' "
            f"(token ids), got {present or 'neither'}")
    value = prompt[present[0]]
    if present[0] == "prompt" and not isinstance(value, str):
        raise InvalidRequestError(f"prompt: 'prompt' must be a string, got "
                                  f"{type(value).__name__}")
    if present[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"prompt: 'prompt_token_ids' must be a list of token ids, "
                                  f"got {type(value).__name__}")
    return value


def _eos_ids(config: EngineConfig, tokenizer: Any) -> set[int]:
    """EOS ids: config.json's and generation_config.json's ``eos_token_id`` (int or list, read
    by ModelConfig) plus the tokenizer's."""
    ids = set(config.hf_config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    ``model``/``tokenizer`` may be injected (tests use a fake model); by default they are
    loaded from ``config.model`` with ``engine.loader``. ``on_parallel_failure(message)`` is
    called once if a rank of a tensor-parallel engine dies or a collective fails (after which
    every step raises ``TensorParallelError``); the worker exits there.
    """

    def __init__(self, config: EngineConfig, *, model: Optional[Any] = None,
                 tokenizer: Optional[Any] = None,
                 on_parallel_failure: Optional[Callable[[str], None]] = None) -> None:
        self.config = config.resolve()
        if tokenizer is None:
            from engine.loader import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        self.model_runner = ModelRunner(config, model, on_parallel_failure=on_parallel_failure)
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   typical_request_tokens=min(self.max_model_len, 512))
        self.eos_token_ids = _eos_ids(config, tokenizer)
        self.sampler = Sampler(self.vocab_size, sorted(self.eos_token_ids))
        self.requests: dict[str, SequenceGroup] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        # Statistics of the steps (the scheduler keeps those of its queues and the KV pool):
        self._num_steps = 0
        self._num_generated_tokens = 0
        self._num_computed_tokens = 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        model = kwargs.pop("model_object", None)
        tokenizer = kwargs.pop("tokenizer_object", None)
        return cls(EngineConfig(**kwargs), model=model, tokenizer=tokenizer)

    # -- requests --------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise InvalidRequestError("prompt: tokenizes to zero tokens")
            return ids
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty")
        self._check_token_ids("prompt", prompt)
        return [int(t) for t in prompt]

    def _check_token_ids(self, field: str, ids: Any) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequestError(f"{field}: token ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{field}: token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, Mapping[str, Any], None] = None,
                    priority: int = 0,
                    resume: Union[ResumeState, Seq[ResumeState], None] = None) -> None:
        """Queue a request. Raises InvalidRequestError / PromptTooLongError (with the numbers)
        or pydantic's ValidationError for bad sampling fields; on error nothing is changed.

        ``resume``: for ``n == 1`` a ResumeState; for ``n > 1`` one per choice (a choice with
        ``finish_reason`` set already ended and is not run). Beam search is never resumed."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.model_validate(dict(params))
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: must be an integer, got {priority!r}")
        if params.min_tokens > params.max_tokens:   # SamplingParams checks it only when set
            raise InvalidRequestError(f"min_tokens: {params.min_tokens} exceeds max_tokens "
                                      f"({params.max_tokens})")
        self._check_width(params)
        prompt = prompt_of(prompt)
        prompt_ids = self._prompt_ids(prompt)
        states = self._resume_states(resume, params)
        p, m = len(prompt_ids), params.max_tokens
        if p + m > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} exceeds max_model_len "
                f"({self.max_model_len})")
        self._check_pool(p, params)

        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        beam = None
        if params.use_beam_search:
            beam = BeamSearch(params.num_choices, length_penalty=params.length_penalty,
                              eos_token_ids=sorted(self.eos_token_ids),
                              ignore_eos=params.ignore_eos, max_tokens=m,
                              min_tokens=params.min_tokens)
        group = SequenceGroup(request_id, params.num_choices, params=params, seed=seed, beam=beam)
        arrival = next(self._arrivals)
        text = prompt if isinstance(prompt, str) else None
        runs = [(0, None)] if states is None else [
            (i, st) for i, st in enumerate(states) if st.finish_reason is None]
        group.forked = group.forked or states is not None
        seqs = []
        for index, state in runs:
            seq = Sequence(request_id, prompt_ids, params, priority=priority,
                           arrival_index=arrival, seed=branch_seed(seed, index), prompt=text,
                           index=index, group=group)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            if state is not None and state.output_token_ids:
                seq.token_ids.extend(state.output_token_ids)
                seq.detokenizer.replay(list(state.output_token_ids), state.output_text)
            seqs.append(seq)
        self.requests[request_id] = group
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_width(self, params: SamplingParams) -> None:
        """Choices past the configured bounds, or more than could ever run at once, are the
        request's error (naming the field) rather than a request that stalls the scheduler."""
        field, limit = (("beam_width", self.config.max_beam_width) if params.use_beam_search
                        else ("n", self.config.max_n))
        width = params.num_choices
        if width > limit:
            raise InvalidRequestError(f"{field}: {width} exceeds this engine's limit of {limit} "
                                      f"(EngineConfig.max_{field})")
        for knob in ("max_num_seqs", "max_num_batched_tokens"):
            cap = int(getattr(self.config, knob))
            if width > 1 and width > cap:
                raise InvalidRequestError(f"{field}: {width} choices cannot run together with "
                                          f"{knob}={cap}")

    def _resume_states(self, resume: Any, params: SamplingParams) -> Optional[list[ResumeState]]:
        """One ResumeState per choice, or None when nothing was delivered (a fresh start)."""
        if resume is None:
            return None
        if params.use_beam_search:
            raise InvalidRequestError("resume: beam search is not resumed; run it again")
        states = [resume] if isinstance(resume, ResumeState) else list(resume)
        if len(states) != params.n or not all(isinstance(s, ResumeState) for s in states):
            raise InvalidRequestError(f"resume: expected {params.n} ResumeState (one per choice)")
        for st in states:
            self._check_token_ids("resume.output_token_ids", st.output_token_ids)
            if st.finish_reason is None and len(st.output_token_ids) >= params.max_tokens:
                raise InvalidRequestError(
                    f"resume: {len(st.output_token_ids)} tokens already emitted, max_tokens is "
                    f"{params.max_tokens}; nothing left to generate")
        if all(st.finish_reason is not None for st in states):
            raise InvalidRequestError("resume: every choice has already finished")
        if all(not st.output_token_ids and st.finish_reason is None for st in states):
            return None
        return states

    def _check_pool(self, p: int, params: SamplingParams) -> None:
        """The request with all its choices must fit the whole pool: the prompt's full blocks
        once, and each choice's own blocks (its copy of the partial block included)."""
        bm = self.block_manager
        m, width = params.max_tokens, params.num_choices
        shortfall = bm.pool_shortfall(p + m - 1)   # the last sampled token needs no KV
        if shortfall is not None:
            raise PromptTooLongError(f"prompt ({p} tokens) + max_tokens ({m}) {shortfall}")
        shared = p // bm.block_size
        need = shared + width * (bm.blocks_for(p + m - 1) - shared)
        if width > 1 and need > bm.num_blocks:
            field = "beam_width" if params.use_beam_search else "n"
            raise PromptTooLongError(
                f"{field}: {width} choices of prompt ({p} tokens) + max_tokens ({m}) need "
                f"{need} KV blocks of {bm.block_size} tokens, the pool has {bm.num_blocks}")

    def abort_request(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks at once. Silent: no delta follows."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return False
        now = time.time()
        for seq in list(group.seqs):
            self.scheduler.finish(seq, "abort")
            seq.finished_time = now
        return True

    def request_seed(self, request_id: str) -> int:
        """The sampling seed of a live request (drawn at add time when it gave none)."""
        group = self.requests.get(request_id)
        if group is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        return group.seed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def free_capacity(self) -> int:
        """How many more requests could start soon (see Scheduler.free_capacity)."""
        return self.scheduler.free_capacity()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduling step; return at most one delta per request that got a token."""
        if not self.scheduler.has_unfinished():
            return []
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        logits, rows = self.model_runner.execute(out.seqs, out.num_new_tokens, out.block_copies)
        self.scheduler.update(out)
        self._num_steps += 1
        self._num_computed_tokens += out.num_batched_tokens
        if not rows:
            return []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        beam_rows: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
        for row, i in enumerate(rows):
            seq = out.seqs[i]
            group = seq.group
            if group.beam is not None:
                beam_rows.setdefault(id(group), (group, {}))[1][id(seq)] = row
                continue
            branches = [seq] if group.forked else fork_samples(seq, self.scheduler,
                                                               self.tokenizer)
            sample_seqs.extend(branches)
            sample_rows.extend([row] * len(branches))
        deltas: list[RequestDelta] = []
        if sample_seqs:
            if len(sample_rows) != logits.shape[0] or sample_rows != list(range(len(sample_rows))):
                logits_s = logits[torch.tensor(sample_rows, device=logits.device)]
            else:
                logits_s = logits
            deltas.extend(self._process_samples(sample_seqs, self.sampler(logits_s, sample_seqs)))
        for group, by_seq in beam_rows.values():
            deltas.extend(self._beam_step(group, by_seq, logits))
        return deltas

    def _beam_step(self, group: SequenceGroup, rows: dict[int, int],
                   logits: torch.Tensor) -> list[RequestDelta]:
        """Rank the beams' continuations; fork and free beams, or return the finished beams."""
        order = [rows[id(s)] for s in group.seqs]
        logprobs = torch.log_softmax(logits[torch.tensor(order, device=logits.device)].float(),
                                     dim=-1).cpu()
        beam = group.beam
        num_prompt = group.seqs[0].num_prompt_tokens
        at_limit = (beam.gen_len + 1 >= group.params.max_tokens
                    or num_prompt + beam.gen_len + 1 >= self.max_model_len)
        step = beam.step(logprobs, length_limit=at_limit)
        now = time.time()
        if not step.done:
            advance_beams(group, step, self.scheduler)
            return []
        deltas = beam_deltas(group, self.scheduler, self.tokenizer)
        group.finished_time = now
        del self.requests[group.request_id]
        self._num_generated_tokens += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    def _process_samples(self, seqs: list[Sequence], sampled) -> list[RequestDelta]:
        now = time.time()
        eos = self.eos_token_ids
        finish: list[Optional[str]] = []
        stop_reasons: list[Union[str, int, None]] = []
        items = []
        for seq, tok, lp, top in zip(seqs, sampled.token_ids, sampled.logprobs,
                                     sampled.top_logprobs):
            p = seq.params
            seq.token_ids.append(tok)
            seq.cumulative_logprob += lp
            if p.logprobs is not None:
                seq.output_logprobs.append(top)
            if seq.first_token_time is None:
                seq.first_token_time = now
            n_out = seq.num_output_tokens
            reason: Optional[str] = None
            stop_reason: Union[str, int, None] = None
            text_tokens = [tok]
            if n_out >= p.min_tokens:
                if tok in p.stop_token_ids:
                    reason, stop_reason, text_tokens = "stop", tok, []
                elif not p.ignore_eos and tok in eos:
                    reason, text_tokens = "stop", []
            if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
                reason = "length"
            finish.append(reason)
            stop_reasons.append(stop_reason)
            items.append((seq.detokenizer, text_tokens, reason is not None))
        texts = detokenize_step(items)
        deltas = []
        for seq, tok, lp, top, reason, stop_reason, (text, stop_str) in zip(
                seqs, sampled.token_ids, sampled.logprobs, sampled.top_logprobs,
                finish, stop_reasons, texts):
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            if reason is not None:
                self._finish_choice(seq, reason, stop_reason, now)
            deltas.append(RequestDelta(
                request_id=seq.request_id,
                new_token_ids=[tok],
                new_text=text,
                logprobs=[top] if seq.params.logprobs is not None else None,
                token_logprobs=[lp],
                finished=reason is not None,
                finish_reason=reason,
                stop_reason=stop_reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                index=seq.index,
                cumulative_logprob=seq.cumulative_logprob,
            ))
        self._num_generated_tokens += len(deltas)
        return deltas

    def _finish_choice(self, seq: Sequence, reason: str, stop_reason: Union[str, int, None],
                       now: float) -> None:
        """One choice ended: free what only it holds; the request ends with its last choice."""
        seq.stop_reason = stop_reason
        seq.finished_time = now
        group = seq.group
        self.scheduler.finish(seq, reason)
        group.finished[seq.index] = seq
        if not group.seqs:
            del self.requests[seq.request_id]

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (also done when it is garbage
        collected or the process exits); nothing to do at size 1."""
        self.model_runner.shutdown()

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benches; the queue and KV figures are the scheduler's."""
        sched = self.scheduler.stats()
        kv = sched.kv
        return {
            "num_preemptions": sched.num_preemptions,
            "kv_blocks_total": kv.blocks_total,
            "kv_blocks_used": kv.blocks_used,
            "kv_blocks_shared": self.block_manager.num_shared_blocks(),
            "kv_blocks_peak": sched.kv_blocks_peak,
            "kv_utilization_peak": sched.kv_utilization_peak,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": kv.prefix_cache_query_tokens,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_running_peak": sched.num_running_peak,
            "num_steps": self._num_steps,
            "num_generated_tokens": self._num_generated_tokens,
            "num_computed_tokens": self._num_computed_tokens,
            "block_size": kv.block_size,
            "max_model_len": self.max_model_len,
        }

    # -- chat ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The checkpoint's chat template applied, with the generation prompt.
        ``chat_template_kwargs`` are variables the template reads (Qwen3's
        ``enable_thinking``), as vLLM and its OpenAI server take them."""
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequestError("messages: must be a list of {'role', 'content'} dicts")
        for m in messages:
            if "role" not in m or "content" not in m:
                raise InvalidRequestError("messages: every message needs 'role' and 'content'")
        kwargs = check_chat_template_kwargs(chat_template_kwargs)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
        # No template in the checkpoint: a plain, readable fallback.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant:"
