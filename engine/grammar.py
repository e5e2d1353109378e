"""Grammars for structured outputs: compiled off the step loop, cached, one matcher per sequence.

A request's constraint (``SamplingParams.structured_outputs``) becomes an llguidance
``LLMatcher`` bound to the engine's tokenizer. Building one is cheap for ordinary schemas but
can take seconds for a hostile one (the lexer of ``a{1000}{1000}`` explodes on its first mask),
so it never runs on the thread that steps the engine: ``GrammarCompiler.submit`` hands the work
to a few threads (llguidance drops the GIL while it compiles), shared fairly among the jobs'
producers (engine/compile_queue.py), and returns a future; the engine keeps the request out of
the scheduler until the future is done (engine/structured.py).

What the pool does for one request (``_prepare``): the compiled template of its canonical spec
(cached, ``_template``), then one deep copy per sequence that starts now, each with the tokens a
resumed choice already delivered consumed (so the resumed answer continues exactly where the
first worker's stopped), and each copy's first mask computed, so the step loop only ever pays
for masks of states one token apart.

The cache is keyed by the canonical spec (``StructuredOutputsParams.canonical``) and keeps
failures too: a spec that does not compile, or whose compile ran past the timeout, fails the
next request at ``add_request`` without compiling again.

The LLTokenizer (llguidance's view of the vocabulary: 0.7 s for SmolLM2's 49k tokens) is built
once, on the first constrained request, in the pool as well. Its vocabulary is the model's
(``vocab_size``, the logits' width): ids past the tokenizer's own are never allowed.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Optional, Sequence

from tokenrelay.engine.compile_queue import FairCompileQueue
from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams, grammar_of, parser_limits

FIELD = "params.structured_outputs"


class GrammarError(InvalidRequestError):
    """A constraint that cannot be used: it does not compile against this tokenizer, its
    compile ran past the timeout, or a matcher failed while decoding. Ends that request alone
    (``invalid_request``: the message starts with ``params.structured_outputs``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message if message.startswith(FIELD) else f"{FIELD}: {message}")


def build_lltokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer from the transformers tokenizer the engine loaded (its Rust
    backend, serialized), with the model's vocabulary size and every EOS id."""
    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer",
                                                                       None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GrammarError(f"structured outputs need a fast (Rust) tokenizer; this model's is "
                           f"{type(tokenizer).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    n_vocab = max(int(vocab_size), len(tokenizer))
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab,
                                  eos_token=sorted(eos_token_ids))


class Constraint:
    """One sequence's matcher: what its output so far allows next."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fork(self) -> "Constraint":
        """An independent copy in the same state (a choice or a beam forking)."""
        return Constraint(self.matcher.deep_copy())

    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token; False puts the matcher in its error state."""
        return bool(self.matcher.consume_token(int(token_id)))

    def error(self) -> Optional[str]:
        """Why the matcher cannot go on (a token it refused, a lexer limit), or None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the matcher failed"

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and can take nothing but EOS."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """The pool, the template cache and the statistics of compiles (see the module docstring).

    Thread safety: ``submit``/``expire``/``stats`` run on the engine's thread, ``_prepare`` on
    the pool's; the cache and counters are guarded by one lock, each spec's compile by its
    own, so two requests with one new spec compile it once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 threads: int, timeout_s: float, cache_size: int = 256,
                 per_owner: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._queue = FairCompileQueue(threads, per_owner)
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Any] = OrderedDict()   # spec -> matcher | GrammarError
        self._compiling: dict[str, tuple[float, threading.Lock]] = {}
        self._lltok: Any = None
        self._lltok_lock = threading.Lock()
        self.compiles = 0
        self.cache_hits = 0
        self.failures = 0
        self.compile_seconds = 0.0

    def submit(self, spec: StructuredOutputsParams, replays: Sequence[Sequence[int]],
               owner: Optional[str] = None) -> "Future[list[Constraint]]":
        """Start preparing one matcher per entry of ``replays`` (the tokens each sequence
        already has), queued fairly among owners (the jobs' producers; None: anonymous).
        Raises GrammarError at once for a spec the cache knows fails."""
        key = spec.canonical
        with self._lock:
            known = self._templates.get(key)
            if known is not None:
                self._templates.move_to_end(key)
            if isinstance(known, GrammarError):
                self.cache_hits += 1
                raise GrammarError(str(known))
        return self._queue.submit(owner, self._prepare, key, [list(r) for r in replays])

    def expire(self, key: str) -> GrammarError:
        """A request waited ``timeout_s`` for ``key``: when that spec's compile itself has run
        that long, remember it as failed (the thread finishes on its own; its result is
        dropped), so the next request with it fails at once."""
        err = GrammarError(f"the grammar did not compile within {self.timeout_s:g} s "
                           f"(grammar_compile_timeout_s); simplify the constraint")
        with self._lock:
            started = self._compiling.get(key)
            if started is not None and time.monotonic() - started[0] >= self.timeout_s:
                self._remember(key, err)
        return err

    def close(self) -> None:
        self._queue.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"grammar_compiles": self.compiles, "grammar_cache_hits": self.cache_hits,
                    "grammar_failures": self.failures,
                    "grammar_compile_seconds": self.compile_seconds,
                    "grammar_cache_size": len(self._templates),
                    "grammar_compile_queued": self._queue.queued()}

    # -- on the pool's threads --------------------------------------------------------------
    def _prepare(self, key: str, replays: list[list[int]]) -> list[Constraint]:
        template = self._template(key)
        out = []
        for tokens in replays:
            c = Constraint(template.deep_copy())
            if tokens and not c.matcher.consume_tokens(tokens):
                raise GrammarError(f"the {len(tokens)} tokens already delivered do not follow "
                                   f"the constraint ({c.error()})")
            self._first_mask(c)
            out.append(c)
        return out

    def _template(self, key: str) -> Any:
        with self._lock:
            entry = self._compiling.setdefault(key, (time.monotonic(), threading.Lock()))
        with entry[1]:                       # one compile per spec; the others wait for it
            with self._lock:
                known = self._templates.get(key)
                if known is not None:
                    self.cache_hits += 1
            if known is None:
                known = self._compile(key)
            with self._lock:
                self._compiling.pop(key, None)
        if isinstance(known, GrammarError):
            raise GrammarError(str(known))
        return known

    def _compile(self, key: str) -> Any:
        """Build, check and warm the template (its first mask builds the lexer's states)."""
        import llguidance

        t0 = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer(), grammar_of(key),
                                           log_level=0, limits=parser_limits())
            problem = matcher.get_error() if matcher.is_error() else ""
            if not problem:
                self._first_mask(Constraint(matcher))
                problem = matcher.get_error() if matcher.is_error() else ""
            result: Any = GrammarError(problem) if problem else matcher
        except GrammarError as exc:
            result = exc
        except Exception as exc:  # a spec llguidance cannot read ends that request alone
            result = GrammarError(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0
            if key not in self._templates:      # expire() may have failed it meanwhile
                self._remember(key, result)
            return self._templates.get(key, result)

    def _remember(self, key: str, result: Any) -> None:
        """Cache ``result`` (under the lock), evicting the least recently used spec."""
        if isinstance(result, GrammarError):
            self.failures += 1
        self._templates[key] = result
        self._templates.move_to_end(key)
        while len(self._templates) > self.cache_size:
            self._templates.popitem(last=False)

    def _lltokenizer(self) -> Any:
        with self._lltok_lock:
            if self._lltok is None:
                self._lltok = build_lltokenizer(self.tokenizer, self.vocab_size,
                                                self.eos_token_ids)
            return self._lltok

    @staticmethod
    def _first_mask(c: Constraint) -> None:
        """Compute (and drop) the mask of the state the step loop will ask about first: what
        it costs to build lexer states is paid here, on the pool's thread."""
        c.matcher.compute_bitmask()
