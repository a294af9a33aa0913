"""Structured output: grammars that constrain what a request may generate, with llguidance.

    compiler = GrammarCompiler(tokenizer, vocab_size)     # once per model: its token view
    grammar = compiler.compile(JsonSchema(schema))         # GrammarError (a 400) if it cannot
    params = GenerationParams(..., grammar=grammar)        # the scheduler does the rest:
    matcher = grammar.matcher()                            # per request, in its start state
    matcher.fill(row)        # its next token's bitmask into an int32 row; False: a dead end
    matcher.accept(token)    # False: the token breaks the grammar (`error` says how)
    matcher.done             # complete: nothing may follow (the request ends, "stop")

A grammar is compiled once per distinct spec (a least-recently-used cache keeps them) on the
compiler's own threads, never the caller's event loop; one that takes longer than the time limit,
or that llguidance cannot build (an unsupported keyword, a bad regex), is a `GrammarError` naming
the problem, and the requests beside it never wait for it. llguidance's parser limits bound what a
grammar may cost per token as well.

JSON comes out compact, with the separators Python's json.dumps writes (", " and ": ") and no
other whitespace: a small model given free whitespace can fill its whole budget with it.

Non-goals: a grammar engine of cadence's own (llguidance is vLLM's and SGLang's too), fast-forward
(forced) tokens, and speculative draft masks.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
from typing import Any

import llguidance
import numpy as np

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.scheduler.errors import SubmissionError

# The JSON grammar's layout (llguidance's JSON compile options): compact, json.dumps' separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a grammar may take to compile (`GrammarCompiler`)
CACHED_GRAMMARS = 256


class GrammarError(SubmissionError):
    """A grammar that cannot be compiled, or not in time; a 400 naming the problem."""


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """Output that is one JSON value valid against `schema` (a dict, as parsed)."""

    schema: Any


@dataclasses.dataclass(frozen=True)
class JsonObject:
    """Output that is one JSON object, any object."""


@dataclasses.dataclass(frozen=True)
class Lark:
    """Output that `grammar` (llguidance's Lark dialect, with its `%json {...}`) derives."""

    grammar: str


@dataclasses.dataclass(frozen=True)
class Regex:
    """Output that matches `pattern` whole."""

    pattern: str


Spec = JsonSchema | JsonObject | Lark | Regex


def _grammar_text(spec: Spec) -> str:
    """llguidance's grammar for a spec (what `LLMatcher` compiles)."""
    if isinstance(spec, JsonObject):
        spec = JsonSchema({"type": "object"})
    if isinstance(spec, JsonSchema):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, overrides=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
    if isinstance(spec, Lark):
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    return llguidance.LLMatcher.grammar_from_regex(spec.pattern)


def _key(spec: Spec) -> str:
    """A spec's cache key: the same schema written in another key order is the same grammar."""
    body = spec.schema if isinstance(spec, JsonSchema) else dataclasses.asdict(spec)
    return type(spec).__name__ + ":" + json.dumps(body, sort_keys=True, separators=(",", ":"))


class Grammar:
    """A compiled grammar: what `GenerationParams.grammar` carries. Immutable and shared by
    every request that asks for the same spec; `matcher()` gives each its own state."""

    def __init__(self, spec: Spec, start: llguidance.LLMatcher, vocab_size: int, seconds: float):
        self.spec = spec
        self._start = start  # the matcher in its start state, copied per request
        self.vocab_size = vocab_size  # of the bitmasks its matchers fill
        self.compile_seconds = seconds

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({type(self.spec).__name__}, {self.compile_seconds * 1e3:.1f} ms)"


class Matcher:
    """One request's place in its grammar, advanced by the tokens it is given."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill(self, row: np.ndarray) -> bool:
        """Writes the bitmask of the tokens that may come next into `row` (int32, one bit per
        token, llguidance's layout); False if none may (a dead end, or the grammar failed)."""
        if not (row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]):
            raise ValueError("a bitmask row is a contiguous int32 array")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return not self._m.is_error() and bool(row.any())

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing more may follow it."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error()) or "no token the grammar allows comes next"


def _first_line(message: str) -> str:
    """llguidance's message on one line, without the parser state and grammar it may append."""
    return " ".join(message.split("\n<state>")[0].split())


def token_view(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`: every id's bytes (special tokens marked special), its
    end-of-sequence ids, and its encoder for the strings a grammar spells out. Ids past the
    tokenizer's vocabulary, up to the model's `vocab_size`, are never allowed."""
    eos = sorted(tokenizer.eos_ids)
    if not eos:
        raise ValueError("structured output needs a tokenizer with an end-of-sequence token")
    special = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
    pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    by_bytes: dict[bytes, int] = {}
    for i, piece in enumerate(pieces):
        if i not in special and piece:
            by_bytes.setdefault(piece, i)
    longest = max(map(len, by_bytes), default=1)

    def greedy(text: bytes) -> list[int]:
        """The longest piece at each point: bytes as they are, where the tokenizer's own
        encoding is not (a byte that is no UTF-8 alone; SentencePiece's leading space)."""
        ids, at = [], 0
        while at < len(text):
            for size in range(min(longest, len(text) - at), 0, -1):
                if (token := by_bytes.get(text[at: at + size])) is not None:
                    ids.append(token)
                    at += size
                    break
            else:
                at += 1  # no piece holds this byte: llguidance falls back to its own
        return ids

    class View:
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_id
        tokens = pieces
        special_token_ids = sorted(special)

        def __call__(self, text: bytes) -> list[int]:
            ids = tokenizer.encode(text.decode("utf-8", errors="replace"), add_bos=False)
            return ids if b"".join(pieces[i] for i in ids) == text else greedy(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(View()), n_vocab=vocab_size,
                                  eos_token=eos)


class GrammarCompiler:
    """Compiles specs into `Grammar`s for one model, on threads of its own, with a time limit,
    remembering the last `cached` it compiled (and sharing one compile between requests that
    ask for a spec at once). Making one costs nothing: the tokenizer's view is built with the
    first compile (on the caller's thread, outside any grammar's time limit)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 timeout: float = DEFAULT_COMPILE_TIMEOUT, cached: int = CACHED_GRAMMARS,
                 workers: int = 2, limits: llguidance.LLParserLimits | None = None):
        """`limits`: llguidance's bounds on a grammar's size and on the work of each token's
        mask (its defaults: `LLParserLimits()`, without the state dumps in error messages)."""
        self.vocab_size = vocab_size
        self.timeout = timeout
        self._tokenizer = tokenizer
        self._view: llguidance.LLTokenizer | None = None
        self._view_lock = threading.Lock()
        self._limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cadence-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cached = cached
        self.compiled = 0  # grammars built (cache misses), and the seconds they took
        self.compile_seconds = 0.0

    def compile(self, spec: Spec) -> Grammar:
        """The grammar of `spec`, from the cache or compiled now (waiting at most `timeout`);
        GrammarError if it cannot be compiled, or its compile takes longer than `timeout` (even
        one that finished while the caller was not looking)."""
        key = _key(spec)
        with self._view_lock:
            if self._view is None:
                self._view = token_view(self._tokenizer, self.vocab_size)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._build, spec)
                while len(self._cache) > self._cached:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        slow = GrammarError(f"the grammar took longer than {self.timeout:g} s to compile; "
                            "simplify the schema")
        try:
            grammar = future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise slow from None
        except GrammarError:
            with self._lock:  # not worth keeping: a resend is as bad
                if self._cache.get(key) is future:
                    del self._cache[key]
            raise
        if grammar.compile_seconds > self.timeout:  # done in time only by luck: the same answer
            raise slow
        return grammar

    def _build(self, spec: Spec) -> Grammar:
        start = time.perf_counter()
        text = _grammar_text(spec)
        matcher = llguidance.LLMatcher(self._view, text, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {_first_line(matcher.get_error())}")
        seconds = time.perf_counter() - start
        with self._lock:
            self.compiled += 1
            self.compile_seconds += seconds
        return Grammar(spec, matcher, self.vocab_size, seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
