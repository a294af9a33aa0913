"""One request's host-side state: what it asked for, where it is, what it has produced.

A request moves WAITING -> PREFILLING -> DECODING -> FINISHED; served disaggregated, it is
TRANSFERRING between PREFILLING and DECODING while its KV waits for, or moves to, the decode
pool. The scheduler owns the state transitions; this module only keeps the bookkeeping honest and turns accepted tokens into
events (ids, UTF-8-safe text deltas, timestamps) with stop strings applied on the text.

`check_params` (with `check_prompt` and `check_length`) is the one validation of generation
parameters: the scheduler runs it on every submission, and the server's request parsing runs
it too, so every front door refuses the same things with the same messages.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cadence.checkpoints.detokenizer import IncrementalDetokenizer
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.prefix_cache import PageKeys
from cadence.scheduler.speculative import Drafter

if TYPE_CHECKING:
    from cadence.scheduler.grammar import BadWords, Grammar, TokenSet


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    # Disaggregated: prefilled, waiting for the decode pool's room (holding prefill pages), or
    # with its KV on its way there (holding decode pages).
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the end of the slot's context
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine failed while serving it


# Stop strings are matched against every token's text on the scheduler thread; these bounds keep
# that work small for every slot. (OpenAI allows 4 stop strings; vLLM and llama.cpp more.)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_PRIORITY = 2**31 - 1  # priorities are integers in [-MAX_PRIORITY, MAX_PRIORITY]
# How an embedding pools its prompt's final hidden states: their mean, or its last token's.
POOLINGS = ("mean", "last")


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_tokens: int | None = None  # None: up to the end of the context
    sampling: RequestSampling = RequestSampling()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # the model's EOS does not end it (its stop_token_ids still do)
    # vLLM's: the first `min_tokens` tokens are never one that would end it (its EOS and stop
    # ids are masked out), and no stop string ends it before then.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end it (vLLM's)
    include_stop: bool = False  # the stop string or stop id that ends it stays in its text (vLLM's)
    # Requests with different salts never share cached KV pages (vLLM's `cache_salt`): a
    # tenant's prompts cannot be probed by another's timing.
    cache_salt: str | None = None
    # None: no logprobs; k: each output token's logprob and its k likeliest alternatives
    # (`TokenEvent.logprobs`), k at most the engine's max_logprobs.
    logprobs: int | None = None
    # None: none; k: also each prompt token's logprob, rank and k likeliest alternatives
    # (`RequestRecord.prompt_logprobs`: echo's, vLLM's prompt_logprobs), from the prompt's
    # forward pass, k at most the engine's max_logprobs; the prompt is then prefilled whole,
    # never taken from the prefix cache.
    prompt_logprobs: int | None = None
    # Lower runs first (vLLM's semantics): it may preempt running requests of a higher number.
    # None: the server's priority classes decide from the prompt's length (0 without classes).
    priority: int | None = None
    # Structured output (`scheduler.grammar`): every token is one the grammar allows, and the
    # request ends ("stop") when the grammar is complete; or vLLM's allowed_token_ids (a
    # `TokenSet`) or bad_words (`BadWords`), which end nothing.
    grammar: Grammar | TokenSet | BadWords | None = None
    # An embedding (one of POOLINGS): the prompt is prefilled, nothing is generated, and the
    # request ends with its final hidden states pooled (`RequestRecord.embedding`). Its prompt
    # is prefilled whole, never taken from the prefix cache, which has no hidden states.
    pooling: str | None = None
    # What its answer is expected to be, mostly (OpenAI's Predicted Outputs): token ids that
    # speculative decoding drafts from (`scheduler.speculative.Drafter`). The answer is the
    # same with or without them; only how many steps it takes changes.
    prediction: tuple[int, ...] = ()
    # Special tokens its text shows, though the others are skipped: those a chat's tool calls
    # are written with where the parser must see them (Mistral's [TOOL_CALLS], [ARGS]).
    shown_specials: tuple[int, ...] = ()
    # False: its text shows every special token it writes (vLLM's skip_special_tokens false);
    # a stop token's only with include_stop, as a stop string's.
    skip_special: bool = True
    # llama-server's return_progress: `PromptProgress` events while its prompt is computed,
    # before its first token.
    progress: bool = False


def check_params(params: GenerationParams, vocab_size: int | None = None, max_logprobs: int | None = None,
                 structured: bool = True, lora_slots: int | None = None) -> None:
    """The one validation of generation parameters, for every front door: raises
    SubmissionError (naming the parameter) for anything the scheduler's loop could not serve.
    The scheduler checks every submission with its engines' `vocab_size`, `max_logprobs`,
    whether they run `structured` output and how many LoRA adapters they hold (`lora_slots`);
    a front door may check earlier without them (what depends on the model is then left to
    the scheduler)."""
    if not isinstance(params.sampling, RequestSampling):
        raise SubmissionError(f"sampling must be a RequestSampling, got {type(params.sampling).__name__}")
    if params.grammar is not None and vocab_size is not None:
        _check_grammar(params, vocab_size, structured)
    outside = [token for token, _ in params.sampling.logit_bias if vocab_size is not None and token >= vocab_size]
    if outside:
        raise SubmissionError(f"logit_bias names token id {outside[0]}, outside the model's "
                              f"vocabulary [0, {vocab_size})", "logit_bias")
    if params.pooling is not None:
        _check_pooling(params)
    beyond = [slot for slot, _ in params.sampling.lora if lora_slots is not None and slot >= lora_slots]
    if beyond:
        raise SubmissionError(f"LoRA adapter {beyond[0]} is not loaded: this server holds "
                              f"{lora_slots} (--lora)", "lora")
    most = max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and most is not None and not (isinstance(k, int) and not isinstance(k, bool)
                                                       and 0 <= k <= most):
            raise SubmissionError(f"at most {most} logprobs per token (the server's --max_logprobs), "
                                  f"got {k!r}", name)
    if params.priority is not None and (isinstance(params.priority, bool)
                                        or not isinstance(params.priority, int)
                                        or not -MAX_PRIORITY <= params.priority <= MAX_PRIORITY):
        raise SubmissionError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] "
                              f"(lower runs first), got {params.priority!r}", "priority")
    if params.max_tokens is not None and (isinstance(params.max_tokens, bool)
                                          or not isinstance(params.max_tokens, int)
                                          or params.max_tokens < 1):
        raise SubmissionError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r}",
                              "max_tokens")
    if (isinstance(params.min_tokens, bool) or not isinstance(params.min_tokens, int)
            or params.min_tokens < 0):
        raise SubmissionError(f"min_tokens must be an integer >= 0, got {params.min_tokens!r}",
                              "min_tokens")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise SubmissionError(f"min_tokens ({params.min_tokens}) exceeds max_tokens "
                              f"({params.max_tokens})", "min_tokens")
    if params.min_tokens and params.grammar is not None and params.grammar.decides_end:
        raise SubmissionError("min_tokens cannot go with a grammar (a response format, a guided "
                              "field or forced tools): the grammar decides where the answer ends",
                              "min_tokens")
    if len(params.stop_token_ids) > MAX_STOP_STRINGS or not all(
            type(t) is int and 0 <= t < (vocab_size or 2**31) for t in params.stop_token_ids):
        raise SubmissionError(f"stop_token_ids must be at most {MAX_STOP_STRINGS} token ids of the "
                              f"model's vocabulary{f' [0, {vocab_size})' if vocab_size else ''}",
                              "stop_token_ids")
    if not isinstance(params.skip_special, bool):
        raise SubmissionError(f"skip_special_tokens must be a boolean, got {params.skip_special!r}",
                              "skip_special_tokens")
    if not all(type(t) is int and 0 <= t < (vocab_size or 2**31) for t in params.shown_specials):
        raise SubmissionError("shown_specials must be token ids of the model's vocabulary")
    if not all(type(t) is int and 0 <= t < (vocab_size or 2**31) for t in params.prediction):
        raise SubmissionError("a prediction must be token ids of the model's vocabulary", "prediction")
    # Stop strings are scanned on the scheduler thread for every token: bound the work.
    if len(params.stop) > MAX_STOP_STRINGS:
        raise SubmissionError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}",
                              "stop")
    for stop in params.stop:
        if not isinstance(stop, str) or not stop or len(stop) > MAX_STOP_LENGTH:
            raise SubmissionError(
                f"stop strings must be non-empty strings of at most {MAX_STOP_LENGTH} "
                f"characters, got {str(stop)[:40]!r}{'...' if len(str(stop)) > 40 else ''}", "stop")


def _check_pooling(params: GenerationParams) -> None:
    if params.pooling not in POOLINGS:
        raise SubmissionError(f"pooling must be one of {', '.join(POOLINGS)}, got {params.pooling!r}",
                              "pooling")
    generating = {"max_tokens": params.max_tokens is not None, "logprobs": params.logprobs is not None,
                  "prompt_logprobs": params.prompt_logprobs is not None,
                  "grammar": params.grammar is not None, "min_tokens": params.min_tokens > 0,
                  "stop": bool(params.stop or params.stop_token_ids)}
    given = [name for name, set_ in generating.items() if set_]
    if given:
        raise SubmissionError(f"an embedding generates nothing: {given[0]} cannot go with pooling",
                              given[0])
    if params.sampling.lora:
        raise SubmissionError("embeddings are the base model's: a LoRA adapter cannot go with "
                              "pooling", "lora")


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """A prompt the model can read: at least one token id, each an integer in its vocabulary."""
    if not prompt_ids:
        raise SubmissionError("the prompt is empty; send at least one token", "prompt")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise SubmissionError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}",
                              "prompt")


def check_length(n: int, max_tokens: int | None, context: int, max_seq_len: int) -> int:
    """The max_tokens a prompt of `n` tokens runs to (None: to the end of `context`, the longest
    sequence the scheduler's pools hold, at most `max_seq_len`); RequestTooLong if it does not fit."""
    room = context - n
    max_tokens = room if max_tokens is None else max_tokens
    if n + max_tokens > context or room < 1:
        limit = (f"context of {context} tokens" if context == max_seq_len else
                 f"{context} tokens the KV pool holds beside its null page (the context is "
                 f"{max_seq_len})")
        raise RequestTooLong(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
            f"{limit}; shorten the prompt or lower max_tokens"
        )
    return max_tokens


def _check_grammar(params: GenerationParams, vocab_size: int, structured: bool) -> None:
    grammar = params.grammar
    if not structured:
        raise SubmissionError("this server runs without structured output (start it with "
                              "--structured_output)", grammar.param)
    if grammar.vocab_size != vocab_size:
        raise SubmissionError(f"the grammar was compiled for a vocabulary of "
                              f"{grammar.vocab_size} tokens; the model has "
                              f"{vocab_size}", grammar.param)
    if params.ignore_eos and grammar.decides_end:
        raise SubmissionError("ignore_eos cannot go with a grammar: the request ends where "
                              "the grammar does", "ignore_eos")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob under the model's raw distribution (`model.sampling.Logprobs`)
    and its likeliest alternatives, as a request with `logprobs` receives it.

    `text` is what the token added to the decoded output: "" for a token that ends inside a
    UTF-8 character (the next one carries the character), and every byte still held at the end,
    so the texts of a request's tokens concatenate to its whole output exactly."""

    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    text: str
    top: tuple[tuple[int, float], ...] | None  # (id, logprob), likeliest first
    # How many ids are at least as likely, itself included (vLLM's rank); prompt tokens' only.
    rank: int | None = None


@dataclasses.dataclass
class TokenEvent:
    """Output produced by one step of a request: usually one token, text possibly empty."""

    token_ids: list[int]
    text: str
    time: float  # time.monotonic() when the scheduler accepted the token
    logprobs: list[TokenLogprob] | None = None  # one per token, if the request asked


@dataclasses.dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt is computed, before its first token (`GenerationParams.progress`;
    llama-server's `prompt_progress`): `processed` of its `total` tokens, of which the prefix
    cache gave `cache`, `elapsed` seconds after its admission."""

    total: int
    cache: int
    processed: int
    elapsed: float


@dataclasses.dataclass
class RequestRecord:
    """The server-side timeline of a finished request (times from time.monotonic())."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    submitted: float
    admitted: float | None
    first_token: float | None
    finished: float
    prefill_chunks: int
    decode_steps: int
    text: str
    # The stop string or stop token id that ended it ("stop" without one: EOS or its grammar).
    stop_reason: str | int | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    output_ids: list[int] = dataclasses.field(default_factory=list)  # every token generated
    # With a prediction: its drafts that verification accepted, and those it rejected.
    prediction_tokens: tuple[int, int] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, if the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None)
    # An embedding's pooled final hidden states ([D] float32; `GenerationParams.pooling`), not
    # normalized.
    embedding: np.ndarray | None = None
    error: str | None = None
    preemptions: int = 0  # times its KV was dropped (for pages or for a higher priority) and recomputed
    priority: int = 0  # the priority it ran at (`GenerationParams.priority`, or its class's)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not prefill
    # The phases around the first decode step (None where they did not happen, e.g. colocated;
    # the prefill ends, on the host, at first_token):
    transfer_start: float | None = None  # disaggregated: its KV was ready to leave the prefill pool
    transfer_end: float | None = None  # ... and had arrived on the decode pool's device
    transfer_bytes: int = 0  # KV bytes moved (all transfers, if it was preempted and moved again)
    first_decode: float | None = None  # its first decode step was dispatched

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted


_ids = itertools.count()


class Request:
    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        max_tokens: int,
        tokenizer: Tokenizer,
        emit: Callable[[TokenEvent | PromptProgress | RequestRecord], None],
        request_id: str | None = None,
        priority: int = 0,
    ):
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.priority = priority  # lower first (`scheduler.policy`)
        self.max_tokens = max_tokens
        # What ends it on its own: the model's EOS (unless ignored) and the request's stop ids.
        model_stops = () if params.ignore_eos else sorted(tokenizer.eos_ids)
        self.eos_ids = frozenset(model_stops) | frozenset(params.stop_token_ids)
        # The same, the model's first: what a device row carries (`SamplingRows.set` keeps the
        # first MAX_STOP_TOKENS), so that many stop ids of its own never push its EOS out.
        self.device_stops = (*model_stops, *(t for t in params.stop_token_ids if t not in model_stops))
        # With include_stop_str_in_output, a stop id's text ends the answer (unless it is a
        # special token), as in vLLM; the model's EOS never shows.
        self._shown_stops = frozenset(t for t in params.stop_token_ids if params.include_stop
                                      and not tokenizer.is_special(t) and t not in tokenizer.eos_ids)
        # min_tokens: whether its sampling row masks its stop ids now (`kv_manager.Pool.set_row`).
        self.masking_stops = False
        self.emit = emit
        self.state = State.WAITING
        self.slot: int | None = None
        self.pool = None  # the scheduler.kv_manager.Pool whose slot it holds, if any
        self.pages: list[int] = []  # the KV pages it holds (in its pool), in position order
        self.unapplied = 0  # dispatched results that include it, not yet applied
        self.landing = None  # disaggregated: its KV handle on its way to the decode device
        # Its stateful sampler's state as it left a slot (preempted, or moved to the decode
        # pool): the engine's read of it (`Pool.leave_slot`), for the slot it takes next.
        self.sampler_left = None
        self.transfer_error: str | None = None  # ... and why it never arrived, if it did not
        # What prefill computes: the prompt, and after a preemption the output so far too
        # (recomputed, never re-emitted: the next token sampled is the next output).
        self.prefill_ids = self.prompt_ids
        # Tokens of prefill_ids whose KV is written; from admission on, with a prefix that ends
        # inside a page, also those its copy (`tail`) will write, queued before its first chunk
        # (`Pool.publish` publishes no page whose copy is still to come).
        self.prefilled = 0
        self.dispatched = 0  # output tokens whose computation has been dispatched
        self.kv_tokens = 0  # positions whose KV is written in its pages
        # The prefix cache (`scheduler.pages`): its full pages' keys, how many of its pages are
        # published, and, while it waits, the cached whole pages its prefill would start after
        # (and `tail`, below).
        self.page_keys: PageKeys | None = None
        self.published = 0
        self.prefix: list[int] = []
        self.prefix_evictable = 0  # of `prefix` and `tail`, pages nobody holds (admission takes them)
        self.cached_tokens = 0  # prompt tokens the cache gave it, at its first admission
        # A prefix that ends inside a page: while it waits, the page whose leading positions it
        # reuses (`tail`: a cached page agreeing with the prompt past `prefix`, or a fork's page
        # holding the prompt's last token); admitted, that page, held until its copy into a
        # page of its own is dispatched (`tail_hold`), and where in its pages the copy goes
        # (`tail_copy_at`).
        self.tail: int | None = None
        self.tail_hold: list[int] = []
        self.tail_copy_at: int | None = None
        # The host tier (`scheduler.host_cache`): while it waits, the host pages that go on from
        # `prefix`; admitted, those still to be copied into its pages from `host_at` on.
        self.host_pages: list = []
        self.host_at = 0
        # A later sequence of a group (n > 1): the group's first, whose prompt KV it takes
        # (`Pool.match_forks`), and whether it will (`forking`, set while it waits; admitted, it
        # says its prefix was counted as forked, not as a cache hit).
        self.fork_parent: Request | None = None
        self.forking = False
        # Speculative decoding: its n-gram drafts and acceptance, from its first drafting
        # iteration on (`scheduler.speculative.Drafter`).
        self.drafter: Drafter | None = None
        # The engines' programs it needs that warm-up left for their first use, compiling
        # (`Engine.prepare`): it waits until they are done, while others run.
        self.compiling: list = []
        self.preemptions = 0
        self.output_ids: list[int] = []
        self.token_times: list[float] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        # Prompt logprobs (`params.prompt_logprobs`): entry p is prompt token p's (p >= 1), with
        # `text` empty (the front door spells the prompt); entry 0 stays None.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(self.prompt_ids) if params.prompt_logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=params.skip_special,
                                            shown=params.shown_specials)
        # Its place in its grammar (structured output), advanced by every token it accepts.
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        # An embedding's (`params.pooling`): the sum of the hidden states of its chunks taken so
        # far, then, from its last chunk's, the pooled result.
        self._hidden_sum: np.ndarray | None = None
        self.embedding: np.ndarray | None = None
        self._held = ""  # text withheld because it may be the start of a stop string
        # The stop string or stop token id (a request's own, not the model's EOS) that ended it.
        self.stop_reason: str | int | None = None
        self._text: list[str] = []
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.cancelled = False
        self.submitted = time.monotonic()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.prefill_chunks = 0
        self.decode_steps = 0
        self.transfer_start: float | None = None
        self.transfer_end: float | None = None
        self.transfer_bytes = 0
        self.first_decode: float | None = None

    @property
    def awaits_parent(self) -> bool:
        """A later sequence of a group waits while the first one's prompt is not yet dispatched:
        once it is, it takes the prompt's KV from it instead of prefilling it again."""
        parent = self.fork_parent
        return (parent is not None and not self.preemptions and not parent.finished
                and parent.state in (State.WAITING, State.PREFILLING))

    def program_groups(self) -> tuple[str, ...]:
        """The engines' program groups (`engine.config.GROUPS`) it runs besides prefill and
        decode."""
        p = self.params
        wanted = {"scoring": p.prompt_logprobs is not None, "pooling": p.pooling is not None,
                  "structured": p.grammar is not None,
                  "history": p.sampling.penalized or p.sampling.stateful,
                  "copy": self.fork_parent is not None}
        return tuple(group for group, needed in wanted.items() if needed)

    def prepare(self, engines, done: Callable) -> None:
        """Starts compiling the programs it needs that warm-up left for their first use, on the
        engines' own threads (`done` called as each finishes); it waits in the queue until they
        are done (`compiling`), while the loop serves the others."""
        groups = self.program_groups()
        for engine in engines if groups else ():
            prepare = getattr(engine, "prepare", None)  # (test doubles compile nothing)
            future = prepare(groups) if prepare is not None else None
            if future is not None:
                self.compiling.append(future)
                future.add_done_callback(done)

    @property
    def pooled_dispatched(self) -> bool:
        """An embedding whose last chunk is dispatched: it only waits for its result, and frees
        its pages then (preempting it would recompute the whole prompt for nothing)."""
        return self.params.pooling is not None and self.state is State.DECODING

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_len(self) -> int:
        return len(self.prefill_ids)

    def token_ids(self, end: int) -> list[int]:
        """Its sequence's token ids at positions [0, end): the prompt, then the output."""
        if end <= self.prompt_len:
            return self.prompt_ids[:end]
        return (self.prompt_ids + self.output_ids)[:end]

    def written_tokens(self) -> int:
        """Leading positions whose tokens the host knows and whose KV has been dispatched to be
        written: what its pages may publish. Decoding, output j's KV is written by the step that
        takes it as input, and an EOS's by none (its row stops)."""
        if self.state in (State.PREFILLING, State.TRANSFERRING):  # prefilled, in the prefill pool
            return self.prefilled
        if self.state is not State.DECODING:
            return 0
        known = len(self.output_ids) - (1 if self.output_ids and self.output_ids[-1] in self.eos_ids else 0)
        return self.prompt_len + max(0, min(known, self.dispatched - 1))

    def prefill_dispatched(self, length: int, final: bool) -> None:
        """A chunk of `length` prompt tokens dispatched; the final one also samples its next
        output token."""
        self.prefilled += length
        self.kv_tokens += length
        self.prefill_chunks += 1
        if final and self.params.pooling is None:  # (an embedding samples nothing)
            self.dispatched = self.prefill_len - self.prompt_len + 1

    def progressed(self, processed: int, now: float) -> None:
        """`processed` of its prompt's tokens computed (cached ones included): a `PromptProgress`
        event, if it asked, until its first token."""
        if self.params.progress and self.first_token is None:
            self.emit(PromptProgress(self.prefill_len, self.cached_tokens, processed,
                                     now - (self.admitted or now)))

    def decode_dispatched(self, tokens: int, steps: int, now: float) -> int:
        """`steps` decode steps dispatched (a verify step counts one) that compute `tokens` of
        its output, each writing its input's KV. Returns the position of the first input."""
        position = self.prompt_len + self.dispatched - 1
        self.dispatched += tokens
        self.kv_tokens += tokens
        self.decode_steps += steps
        self.first_decode = self.first_decode or now
        return position

    def not_emitted(self, tokens: int) -> None:
        """A verify step emitted `tokens` fewer than it was dispatched for: its drafts from the
        first rejected on computed nothing, and their KV is not the sequence's."""
        self.dispatched -= tokens
        self.kv_tokens -= tokens

    def preempted(self) -> None:
        """Back to waiting, holding nothing: its KV is recomputed from prompt + output when
        it is admitted again (`readmitted`)."""
        self.state = State.WAITING
        self.slot = None
        self.prefilled = self.kv_tokens = 0
        self._hidden_sum = None  # its chunks' results still in flight are dropped (`take_pooled`)
        self.preemptions += 1

    def readmitted(self) -> None:
        """Taking a slot again after a preemption: every output so far is accepted by now (its
        last decode step was applied before it could be planned again), so prefill covers them."""
        self.prefill_ids = self.prompt_ids + self.output_ids
        self.dispatched = len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def accept(self, token: int, now: float,
               logprob: tuple[float, Sequence[int], Sequence[float]] | None = None) -> FinishReason | None:
        """Takes one sampled token (and, if the request asked, its logprob and the engine's
        alternatives: the first `params.logprobs` are kept); emits its event; returns a reason
        if the request ends."""
        eos = token in self.eos_ids
        if self.matcher is not None and not eos and not self.matcher.accept(token):
            raise ValueError(f"the engine gave token {token}, which the request's grammar does "
                             f"not allow ({self.matcher.error})")
        if self.first_token is None:
            self.progressed(self.prefill_len, now)  # (its last chunk's, with its first token)
            self.first_token = now
        self.output_ids.append(token)
        self.token_times.append(now)
        reason = None
        if eos:
            reason = FinishReason.STOP
            if token in self.params.stop_token_ids:
                self.stop_reason = token
            shown = token in self._shown_stops
            delta = (self.detok.add(token) if shown else "") + self.detok.flush()
        else:
            delta = self.detok.add(token)
            if len(self.output_ids) >= self.max_tokens:
                reason = FinishReason.LENGTH
            elif self.matcher is not None and self.matcher.done:  # nothing may follow
                reason = FinishReason.STOP
            if reason is not None:
                delta += self.detok.flush()
        text, stopped = self._apply_stop(delta, final=reason is not None)
        if stopped:
            reason = FinishReason.STOP
        self._text.append(text)
        entry = None
        if self.logprobs is not None:
            if logprob is None:
                raise ValueError("the engine gave no logprobs for a request that asked for them")
            value, ids, values = logprob
            k = self.params.logprobs
            entry = TokenLogprob(token, float(value), delta,
                                 tuple(zip(map(int, ids[:k]), map(float, values[:k]))))
            self.logprobs.append(entry)
        self.emit(TokenEvent([token], text, now, None if entry is None else [entry]))
        return reason

    def masks_stops(self) -> bool:
        """Whether the next token it samples is one of its first `min_tokens`, which its stop
        ids must not be (what its sampling row masks)."""
        return self.dispatched < self.params.min_tokens

    def _apply_stop(self, delta: str, final: bool) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). Before `min_tokens`
        tokens no stop string ends it (vLLM's rule): the text goes out as it comes."""
        if not self.params.stop or len(self.output_ids) < self.params.min_tokens:
            return delta, False  # (nothing is held before min_tokens)
        pending = self._held + delta
        # The earliest match ends the text (of two at one place, the first listed).
        cut, _, hit = min(((i, k, s) for k, s in enumerate(self.params.stop)
                           if (i := pending.find(s)) >= 0), default=(-1, 0, None))
        if cut >= 0:
            self._held = ""
            self.stop_reason = hit
            return pending[:cut + (len(hit) if self.params.include_stop else 0)], True
        if final or self._hold == 0:
            self._held = ""
            return pending, False
        keep = min(self._hold, len(pending))
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False

    def take_scores(self, scores, start: int) -> None:
        """A scored chunk's prompt logprobs (`engine.api`'s scores of the chunk that starts at
        `start`): position p's scores are prompt token p + 1's."""
        if self.finished:
            return
        k = self.params.prompt_logprobs
        for i, (value, ids, values, rank) in enumerate(zip(*scores)):
            p = start + i + 1
            if p >= self.prompt_len:
                break
            self.prompt_logprobs[p] = TokenLogprob(self.prompt_ids[p], float(value), "", tuple(
                zip(map(int, ids[:k]), map(float, values[:k]))), int(rank))

    def take_pooled(self, hidden_sum: np.ndarray, last: np.ndarray, final: bool) -> bool:
        """An embedding's chunk's results (`engine.api`'s pooled: its positions' final hidden
        states summed, and its last one's), in prompt order; returns whether the embedding is
        complete (`final`: the prompt's last chunk). Results of chunks dispatched before a
        preemption arrive while it waits, and are dropped: its prefill starts over."""
        if self.finished or self.state is State.WAITING:
            return False
        self._hidden_sum = hidden_sum if self._hidden_sum is None else self._hidden_sum + hidden_sum
        if final:
            self.embedding = (self._hidden_sum / np.float32(self.prompt_len)
                              if self.params.pooling == "mean" else np.asarray(last))
        return final

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> RequestRecord:
        self.state = State.FINISHED
        if self._held and reason in (FinishReason.ABORT, FinishReason.ERROR):
            self._held = ""  # nothing more will be shown to a client that is gone
        record = RequestRecord(
            request_id=self.id,
            prompt_tokens=self.prompt_len,
            output_tokens=len(self.output_ids),
            finish_reason=reason.value,
            submitted=self.submitted,
            admitted=self.admitted,
            first_token=self.first_token,
            finished=now,
            prefill_chunks=self.prefill_chunks,
            decode_steps=self.decode_steps,
            text="".join(self._text),
            stop_reason=self.stop_reason,
            token_times=self.token_times,
            output_ids=self.output_ids,
            prediction_tokens=((self.drafter.prediction_accepted, self.drafter.prediction_rejected)
                               if self.drafter else (0, 0)) if self.params.prediction else None,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.embedding,
            error=error,
            preemptions=self.preemptions,
            priority=self.priority,
            cached_tokens=self.cached_tokens,
            transfer_start=self.transfer_start,
            transfer_end=self.transfer_end,
            transfer_bytes=self.transfer_bytes,
            first_decode=self.first_decode,
        )
        self.emit(record)
        return record
