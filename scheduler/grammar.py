"""Structured output: grammars that constrain what a request may generate, with llguidance.

    compiler = GrammarCompiler(tokenizer, vocab_size)     # once per model: its token view
    grammar = compiler.compile(JsonSchema(schema))         # GrammarError (a 400) if it cannot
    params = GenerationParams(..., grammar=grammar)        # the scheduler does the rest:
    matcher = grammar.matcher()                            # per request, in its start state
    matcher.fill(row)        # its next token's bitmask into an int32 row; False: a dead end
    matcher.accept(token)    # False: the token breaks the grammar (`error` says how)
    matcher.done             # complete: nothing may follow (the request ends, "stop")

Specs: `JsonSchema`, `JsonObject`, `Regex`, `Choice` (one of some strings), `Lark`
(llguidance's dialect), `ContextFree` (llama.cpp's GBNF or Lark, as clients send them), and
`Thinking` around any of them (below). Beside grammars, `TokenSet` (vLLM's allowed_token_ids)
and `BadWords` (its bad_words) take the same path with masks of their own, and never end a
request.

A grammar is compiled once per distinct spec (a least-recently-used cache keeps them) on the
compiler's own threads, never the caller's event loop; one that takes longer than the time limit,
or that llguidance cannot build (an unsupported keyword, a bad regex), is a `GrammarError` naming
the problem, and the requests beside it never wait for it. llguidance's parser limits bound what a
grammar may cost per token as well.

JSON comes out compact, with the separators Python's json.dumps writes (", " and ": ") and no
other whitespace: a small model given free whitespace can fill its whole budget with it.
Schemas from clients go through `closed_schema` first (vLLM's default and OpenAI's strict mode):
an object that names its properties allows no others unless it says so (`additionalProperties`,
`patternProperties`), and an integer without bounds is bounded to what every JSON parser holds
exactly (|n| < 2**53), so a model cannot fill its budget with keys or digits either.
A grammar whose start allows no token at all (a schema that only refers to itself) is refused
when it compiles, before a request is admitted with it.

`Thinking(spec)` lets a thinking model reason first: `<think>`, any text through the first
`</think>`, newlines, then `spec`'s grammar, referenced as a grammar of its own (llguidance's
`@name`), so a JSON schema or a tool call's Lark keeps its own compile options.

Compiles run on the compiler's own bounded pool; a front door on an event loop awaits
`compile_async`, which holds no thread while it waits, so requests without grammars never queue
behind a slow schema. The time limit counts from the compile's own start, not from the wait
for a free compile thread.

Non-goals: a grammar engine of cadence's own (llguidance is vLLM's and SGLang's too), fast-forward
(forced) tokens, and speculative draft masks.
"""

from __future__ import annotations

import asyncio
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
from cadence.model.host_sampling import bitmask_words
from cadence.scheduler.errors import Overloaded, SubmissionError

# The JSON grammar's layout (llguidance's JSON compile options): compact, json.dumps' separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a grammar may take to compile (`GrammarCompiler`)
CACHED_GRAMMARS = 256
MAX_PENDING_COMPILES = 64  # compiles queued or running at once; past it a new one is a 429
# Integer bounds `closed_schema` gives an unbounded integer: JSON's exact integers (IEEE doubles,
# which JavaScript and many parsers read numbers into), inside int64 too.
JSON_SAFE_INTEGER = 2**53 - 1


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


@dataclasses.dataclass(frozen=True)
class Choice:
    """Output that is exactly one of `options`."""

    options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ContextFree:
    """Output that `grammar` derives: llama.cpp's GBNF (`root ::= ...`, what vLLM's
    `guided_grammar` and llama-server's `grammar` take) or llguidance's Lark, told apart by
    llguidance."""

    grammar: str


@dataclasses.dataclass(frozen=True)
class Thinking:
    """Output that reasons first, free, then follows `answer`: `<think>`, any text up to the
    first `</think>`, newlines, then what `answer` derives. A thinking model (Qwen3,
    DeepSeek-R1) asked for a format still thinks before it answers in it. `opened`: the prompt
    wrote the `<think>` (the output starts inside the reasoning)."""

    answer: JsonSchema | JsonObject | Lark | Regex | Choice | ContextFree
    opened: bool = False


Spec = JsonSchema | JsonObject | Lark | Regex | Choice | ContextFree | Thinking

# Where a JSON schema keeps subschemas: one schema, a list of them, or a name -> schema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords beside `properties` that may admit more properties: an object with any of them is
# left open (closing it could forbid what they allow).
_OPENERS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties",
                      "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"})


def subschemas(schema: dict) -> list[tuple[str, dict]]:
    """A schema's direct subschemas, each with the keyword that holds it."""
    found = []
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            found.append((key, schema[key]))
    for key in _MANY:
        if isinstance(schema.get(key), list):
            found.extend((key, item) for item in schema[key] if isinstance(item, dict))
    if isinstance(schema.get("items"), list):  # draft 4's tuple form
        found.extend(("items", item) for item in schema["items"] if isinstance(item, dict))
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            found.extend((key, item) for item in schema[key].values() if isinstance(item, dict))
    return found


def map_schema(schema: dict, change) -> dict:
    """A copy of `schema` with `change(node, keyword)` applied to it and every subschema, depth
    first (`keyword`: what holds the node, None at the root). `change` edits the node's copy
    in place. Schemas come from parsed client JSON, so their depth is already bounded."""

    def walk(node: dict, keyword: str | None) -> dict:
        node = dict(node)
        for key in _ONE:
            if isinstance(node.get(key), dict):
                node[key] = walk(node[key], key)
        for key in (*_MANY, "items"):
            if isinstance(node.get(key), list):
                node[key] = [walk(i, key) if isinstance(i, dict) else i for i in node[key]]
        for key in _NAMED:
            if isinstance(node.get(key), dict):
                node[key] = {k: walk(v, key) if isinstance(v, dict) else v for k, v in node[key].items()}
        change(node, keyword)
        return node

    return walk(schema, None)


def closed_schema(schema: dict) -> dict:
    """`schema` as cadence enforces it: an object schema that lists `properties` and nothing
    that could admit others gets `additionalProperties: false` (not inside `allOf`, whose
    branches add up), and an integer schema without a bound gets +-`JSON_SAFE_INTEGER`."""

    def close(node: dict, keyword: str | None) -> None:
        if isinstance(node.get("properties"), dict) and keyword != "allOf" and not _OPENERS & node.keys():
            node["additionalProperties"] = False
        types = node.get("type")
        if types == "integer" or (isinstance(types, list) and "integer" in types):
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -JSON_SAFE_INTEGER
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = JSON_SAFE_INTEGER

    return map_schema(schema, close)


# The reasoning of `Thinking`: any text through the first `</think>`, and no further.
_THOUGHT = r'THOUGHT: /(?s:.*)<\/think>/ & ~/(?s:.*<\/think>.+)/'


def _grammar_text(spec: Spec) -> str:
    """llguidance's grammar for a spec (what `LLMatcher` compiles)."""
    if isinstance(spec, Thinking):  # the reasoning, then the answer's grammar by reference
        answer = _grammar_text(spec.answer)
        try:
            grammars = json.loads(answer)["grammars"]  # a JSON schema's: a top-level grammar
        except ValueError:
            grammars = [{"lark_grammar": answer}]  # Lark text
        grammars[0] = {**grammars[0], "name": "answer"}
        opening = "" if spec.opened else '"<think>" '
        main = f"start: {opening}THOUGHT /\\n*/ @answer\n{_THOUGHT}\n"
        return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": main}, *grammars]})
    if isinstance(spec, JsonObject):
        spec = JsonSchema({"type": "object"})
    if isinstance(spec, JsonSchema):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, overrides=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
    if isinstance(spec, Lark):
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    if isinstance(spec, Choice):
        return llguidance.grammar_from("choice", json.dumps(spec.options))
    if isinstance(spec, ContextFree):
        try:
            return llguidance.grammar_from("grammar", spec.grammar)
        except ValueError as e:  # (GBNF that does not convert)
            raise GrammarError(f"the grammar cannot be used: {_first_line(str(e))}") from None
    return llguidance.LLMatcher.grammar_from_regex(spec.pattern)


def _key(spec: Spec) -> str:
    """A spec's cache key: the same schema written in another key order is the same grammar."""
    body = spec.schema if isinstance(spec, JsonSchema) else dataclasses.asdict(spec)
    return type(spec).__name__ + ":" + json.dumps(body, sort_keys=True, separators=(",", ":"))


class Grammar:
    """A compiled grammar: what `GenerationParams.grammar` carries. Immutable and shared by
    every request that asks for the same spec; `matcher()` gives each its own state."""

    decides_end = True  # complete, it ends the request ("stop"), and nothing else may
    param = "response_format"  # the request field its errors name

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

    def allows(self, drafts: list[int]) -> int:
        """How many of `drafts`, from the start, the grammar allows next (the state is kept)."""
        return self._m.validate_tokens(drafts)

    def draft_masks(self, drafts: list[int], rows: np.ndarray) -> bool:
        """Fills `rows` [len(drafts) + 1, words] with the bitmask before each draft and after
        the last, as `fill` would after taking each (speculative decoding's verify step samples
        each position among them), and leaves the state as it was. The grammar must allow the
        drafts (`allows`). False if it allows nothing now, as `fill`."""
        if not self.fill(rows[0]):
            return False
        for i, token in enumerate(drafts):
            if not self._m.consume_token(token):
                raise ValueError(f"draft {token} is not one the grammar allows here")
            self.fill(rows[i + 1])
        self._m.rollback(len(drafts))
        return True

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing more may follow it."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error()) or "no token the grammar allows comes next"


class TokenSet:
    """vLLM's `allowed_token_ids` as a constraint for the bitmask path, in place of a grammar:
    every token the request samples is one of `ids`, at every step. It never completes, so it
    decides nothing about the answer's end: an end-of-sequence token ends it where `ids` holds
    one, and the length, stop strings and `min_tokens` act as they do without a constraint."""

    decides_end = False
    param = "allowed_token_ids"
    compile_seconds = 0.0

    def __init__(self, ids: frozenset[int], vocab_size: int):
        self.ids, self.vocab_size = ids, vocab_size
        bits = np.zeros(bitmask_words(vocab_size), np.uint32)
        for token in ids:
            bits[token >> 5] |= np.uint32(1 << (token & 31))  # llguidance's layout
        self.row = bits.view(np.int32)

    def matcher(self) -> TokenSetMatcher:
        return TokenSetMatcher(self)

    def __repr__(self) -> str:
        return f"TokenSet({len(self.ids)} tokens)"


class TokenSetMatcher:
    """`Matcher`'s interface over a `TokenSet`, which has no state."""

    done = False

    def __init__(self, tokens: TokenSet):
        self._tokens = tokens

    def fill(self, row: np.ndarray) -> bool:
        row[:] = self._tokens.row
        return True

    def accept(self, token: int) -> bool:
        return token in self._tokens.ids

    def allows(self, drafts: list[int]) -> int:
        return next((i for i, token in enumerate(drafts) if token not in self._tokens.ids), len(drafts))

    def draft_masks(self, drafts: list[int], rows: np.ndarray) -> bool:
        rows[: len(drafts) + 1] = self._tokens.row
        return True

    @property
    def error(self) -> str:
        return "the token is not one of allowed_token_ids"


class BadWords:
    """vLLM's `bad_words` as a constraint for the bitmask path: each word's tokens
    (`words`, each a tuple of ids) never all appear at the end of the answer. Where the answer
    ends with all but a word's last token, that token is masked out (a one-token word always
    is), as vLLM's sampler masks it. It never completes a request, as `TokenSet`."""

    decides_end = False
    param = "bad_words"
    compile_seconds = 0.0

    def __init__(self, words: tuple[tuple[int, ...], ...], vocab_size: int):
        self.words, self.vocab_size = words, vocab_size
        self.endings = [(list(w[:-1]), w[-1]) for w in words]  # (all but its last token, that one)
        self.reach = max(len(before) for before, _ in self.endings)  # the answer's tokens they read

    def matcher(self) -> BadWordsMatcher:
        return BadWordsMatcher(self)

    def __repr__(self) -> str:
        return f"BadWords({len(self.words)} token sequences)"


class BadWordsMatcher:
    """`Matcher`'s interface over `BadWords`: its state is the answer's last tokens, as many as
    the longest word reads (`BadWords.reach`), so a step's work is the words', not the answer's."""

    done = False

    def __init__(self, bad: BadWords):
        self._bad, self._out = bad, []

    def _masked(self, out: list[int]) -> set[int]:
        """The tokens that would end `out` with a whole bad word."""
        return {last for before, last in self._bad.endings
                if len(before) <= len(out) and before == out[len(out) - len(before):]}

    def _write(self, row: np.ndarray, out: list[int]) -> bool:
        bits = row.view(np.uint32)
        bits[:] = np.uint32(0xFFFFFFFF)
        for token in self._masked(out):
            bits[token >> 5] &= ~np.uint32(1 << (token & 31))
        return True

    def fill(self, row: np.ndarray) -> bool:
        return self._write(row, self._out)

    def accept(self, token: int) -> bool:
        if token in self._masked(self._out):
            return False
        self._out.append(token)
        if len(self._out) > 2 * self._bad.reach:  # (trimmed now and then, not every token)
            del self._out[: len(self._out) - self._bad.reach]
        return True

    def allows(self, drafts: list[int]) -> int:
        out = list(self._out)
        for i, token in enumerate(drafts):
            if token in self._masked(out):
                return i
            out.append(token)
        return len(drafts)

    def draft_masks(self, drafts: list[int], rows: np.ndarray) -> bool:
        for i in range(len(drafts) + 1):
            self._write(rows[i], self._out + list(drafts[:i]))
        return True

    @property
    def error(self) -> str:
        return "the token completes one of bad_words"


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


class _Job:
    """One spec's compile: `started` resolves to its start (time.perf_counter()) once a compile
    thread takes it, `done` to its Grammar or GrammarError."""

    def __init__(self):
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.done: concurrent.futures.Future = concurrent.futures.Future()


def _on_loop(future: concurrent.futures.Future) -> asyncio.Future:
    """A compile thread's `future` as a future of the running loop, which cancelling leaves the
    compile alone. Its outcome is handed over only while the loop is open: a compile can outlive
    the loop of the request that asked for it (a server stopped meanwhile), and
    `asyncio.wrap_future` would then call into the closed loop from the compile's thread."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle() -> None:
        if waiter.done():  # (cancelled: its caller stopped waiting)
            return
        if future.cancelled():
            waiter.cancel()
        elif future.exception() is not None:
            waiter.set_exception(future.exception())
        else:
            waiter.set_result(future.result())

    def hand_over(_: concurrent.futures.Future) -> None:
        try:
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle)
        except RuntimeError:  # closed between the check and the call
            pass

    future.add_done_callback(hand_over)
    return waiter


class GrammarCompiler:
    """Compiles specs into `Grammar`s for one model, on threads of its own, with a time limit,
    remembering the last `cached` it compiled (and sharing one compile between requests that
    ask for a spec at once). Making one costs nothing: the tokenizer's view is built with the
    first compile (on the caller's thread, outside any grammar's time limit)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 timeout: float = DEFAULT_COMPILE_TIMEOUT, cached: int = CACHED_GRAMMARS,
                 workers: int = 2, limits: llguidance.LLParserLimits | None = None,
                 max_pending: int = MAX_PENDING_COMPILES):
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
        self._cache: collections.OrderedDict[str, _Job] = collections.OrderedDict()
        self._cached = cached
        self.max_pending = max_pending
        self._pending = 0  # compiles queued or running
        self._unfinished: set[_Job] = set()  # their jobs, which `close` ends for their waiters
        self.compiled = 0  # grammars built (cache misses), and the seconds they took
        self.compile_seconds = 0.0

    def _job(self, spec: Spec) -> _Job:
        """The compile of `spec`: cached, or shared with a compile under way, or started now."""
        key = _key(spec)
        with self._lock:
            job = self._cache.get(key)
            if job is None:
                if self._pending >= self.max_pending:
                    raise Overloaded(f"{self._pending} grammars are compiling; retry shortly", retry_after=2)
                job = self._cache[key] = _Job()
                self._pending += 1
                self._unfinished.add(job)
                job.done.add_done_callback(lambda _, job=job: self._finished(job))
                self._pool.submit(self._build, spec, job)
                while len(self._cache) > self._cached:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return job

    def _finished(self, job: _Job) -> None:
        with self._lock:
            self._pending -= 1
            self._unfinished.discard(job)

    def _slow(self) -> GrammarError:
        return GrammarError(f"the grammar took longer than {self.timeout:g} s to compile; "
                            "simplify the schema")

    def _checked(self, spec: Spec, job: _Job, grammar: Grammar | None) -> Grammar:
        """A finished job's grammar, or the GrammarError it failed with (then forgotten: a
        resend is as bad), or the time-limit error for one that took too long."""
        error = job.done.exception()
        if error is not None:
            with self._lock:
                if self._cache.get(_key(spec)) is job:
                    del self._cache[_key(spec)]
            raise error
        if grammar.compile_seconds > self.timeout:  # done in time only by luck: the same answer
            raise self._slow()
        return grammar

    def compile(self, spec: Spec) -> Grammar:
        """The grammar of `spec`, from the cache or compiled now, waiting for it on this thread;
        GrammarError if it cannot be compiled, or its compile takes longer than `timeout` (even
        one that finished while the caller was not looking); Overloaded if too many compiles are
        pending."""
        job = self._job(spec)
        started = job.started.result()
        try:
            grammar = job.done.result(timeout=max(0.0, started + self.timeout - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            raise self._slow() from None
        except GrammarError:
            grammar = None
        return self._checked(spec, job, grammar)

    async def compile_async(self, spec: Spec) -> Grammar:
        """`compile` for an event loop: awaits the compile without holding a thread, so a
        request without a grammar never waits behind one. A caller cancelled meanwhile leaves
        the compile to finish for whoever else asks for the spec."""
        job = self._job(spec)
        if not job.done.done():  # (a cached one is: its wrapper would finish a loop turn later)
            started = await _on_loop(job.started)
            try:
                await asyncio.wait_for(_on_loop(job.done),
                                       max(0.0, started + self.timeout - time.perf_counter()))
            except TimeoutError:
                raise self._slow() from None
            except GrammarError:
                pass
        return self._checked(spec, job, None if job.done.exception() else job.done.result())

    def _build(self, spec: Spec, job: _Job) -> None:
        try:
            with self._view_lock:  # built once, before the first compile's clock starts
                if self._view is None:
                    self._view = token_view(self._tokenizer, self.vocab_size)
            start = time.perf_counter()
            _settle(job.started, start)
            text = _grammar_text(spec)
            matcher = llguidance.LLMatcher(self._view, text, log_level=0, limits=self._limits)
            if matcher.is_error():
                raise GrammarError(f"the grammar cannot be compiled: {_first_line(matcher.get_error())}")
            first = Matcher(matcher.deep_copy())
            if not first.fill(np.zeros(bitmask_words(self._view.vocab_size), np.int32)):
                reason = first.error.replace("<non-verbose/>", "").strip()
                if reason in ("", "NoExtensionBias"):  # llguidance's word for "no way to begin"
                    reason = "no token can begin it (a schema that only refers to itself, say)"
                raise GrammarError(f"the grammar allows no output at all: {reason}")
            seconds = time.perf_counter() - start
            with self._lock:
                self.compiled += 1
                self.compile_seconds += seconds
            _settle(job.done, Grammar(spec, matcher, self.vocab_size, seconds))
        except BaseException as e:  # every waiter hears of it, whatever it is
            _settle(job.started, time.perf_counter())
            _settle(job.done, error=e)

    def close(self) -> None:
        """Stops compiling: queued compiles never start, and whoever waits for one that has not
        finished hears GrammarError at once (a compile under way runs on to no one)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            unfinished = list(self._unfinished)
        for job in unfinished:
            _settle(job.started, time.perf_counter())
            _settle(job.done, error=GrammarError("the server is shutting down; the grammar was not compiled"))


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Resolves `future` unless something else did first (a compile and `close` race)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
