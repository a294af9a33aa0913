"""What the scheduler's tests share: a fake engine, a byte-level tokenizer, a synchronous driver.

`FakeEngine` honours the engine contract exactly (see engine/engine.py): it keeps per-slot "KV"
content (the token ids written at each position) and `last_tokens`; prefill writes a chunk at
[start, start+len), decode writes each active slot's last token at positions[s]. The next token
is a pure function of the slot's content [0, pos], so a wrong position, a stale or mixed-up slot,
or a skipped chunk yields a different token than `expected()` (a plain sequential simulation)
predicts. A script can force specific tokens (EOS, text for stop strings) after a given prompt.

`Harness` drives a scheduler over fake engines synchronously with `step()`; `collect` reads a
stream from a plain thread; `run_random_load` submits and cancels at random steps.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from tokenizers.pre_tokenizers import ByteLevel

from cadence.checkpoints.detokenizer import byte_level_piece_bytes
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.config import EngineConfig
from cadence.engine.results import DecodeTokens, PrefillTokens
from cadence.model import cpu_kernels
from cadence.model.config import TINY
from cadence.model.host_sampling import SAMPLER_STATE, RequestSampling, bitmask_words
from cadence.model.sampling import SamplingParams
from cadence.scheduler.pages import NULL_PAGE
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams, PromptProgress, RequestRecord, TokenEvent
from cadence.scheduler.scheduler import RequestStream, Scheduler, SchedulerConfig

# --- a byte-level tokenizer: id b is byte b, then three special tokens (and any more) -------------


def byte_tokenizer(more_specials: tuple[str, ...] = ()) -> Tokenizer:
    byte_char = {byte_level_piece_bytes(c)[0]: c for c in ByteLevel.alphabet()}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *more_specials]
    return Tokenizer.from_gguf_fields({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [byte_char[b] for b in range(256)] + specials,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [1] * 256 + [3] * len(specials),
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.ggml.eot_token_id": 256,
    })


TOK = byte_tokenizer()
EOS = 258
ALPHABET = [ord(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.choice(ALPHABET, n)]


# --- the fake engine --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prefill:
    slot: int
    start: int
    length: int
    final: bool


@dataclasses.dataclass(frozen=True)
class Decode:
    slots: tuple[int, ...]  # active slots
    positions: tuple[int, ...]  # their positions, in the same order (of the first step)
    steps: int = 1


def masked(sampling: SamplingParams, slot: int) -> frozenset[int]:
    """The ids a slot's sampling row biases to -inf: never sampled (min_tokens' stop ids)."""
    return frozenset(sampling.bias_ids[slot][np.isneginf(sampling.bias_values[slot])].tolist())


class Later:
    """A result its device is still computing: `np.asarray` waits until `ready_at`
    (`time.monotonic()`), as reading a dispatched JAX array waits for its program."""

    def __init__(self, array: np.ndarray, ready_at: float):
        self.array, self.ready_at = array, ready_at

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.array if dtype is None else self.array.astype(dtype)


class FakeEngine:
    """The engine contract, in NumPy, with a deterministic "model" over each sequence's content.

    KV is a pool of pages of token ids; every read and write goes through the page table the
    scheduler passes, so a wrong, stale or shared page changes what the "model" sees."""

    def __init__(self, *, num_slots: int = 4, max_seq_len: int = 1024, prefill_chunk: int = 64,
                 page_size: int = 16, num_pages: int | None = None,
                 script: dict[tuple[int, ...], list[int]] | None = None, eos_one_in: int = 0,
                 decode_delay: float = 0.0, decode_steps: int = 1, speculative_tokens: int = 0,
                 speculative_batch: int = 4, quoting: bool = False,
                 device_seconds: Callable[[list, int], float] | None = None,
                 vocab_size: int = TOK.vocab_size):
        self.config = EngineConfig(num_slots=num_slots, max_seq_len=max_seq_len,
                                   prefill_chunk=prefill_chunk, page_size=page_size,
                                   num_pages=num_pages, decode_steps=decode_steps,
                                   structured_output=True, speculative_tokens=speculative_tokens,
                                   speculative_batch=speculative_batch)
        self.model_config = dataclasses.replace(TINY, vocab_size=vocab_size,
                                                max_context=max_seq_len)
        self.compilations_after_warmup = 0
        self.num_pages = self.config.pool_pages
        self.kv_cache_bytes = self.num_pages * page_size
        self.pool = np.full((self.num_pages, page_size), -1, np.int64)  # -1: never written
        self.last_tokens = np.zeros(num_slots, np.int64)
        self.script = {tuple(k): list(v) for k, v in (script or {}).items()}
        self.eos_one_in = eos_one_in  # > 0: EOS when the content's hash is divisible by it
        # A "model" that quotes: two times in three, the token that followed the last token's
        # previous occurrence (so prompt-lookup drafts are often right, and sometimes wrong).
        self.quoting = quoting
        self.decode_delay = decode_delay
        # A device that takes time: `device_seconds(chunks, decode_rows)` for each program,
        # run one after another from its dispatch; its results are `Later` until then.
        self.device_seconds = device_seconds
        self._device_free = 0.0
        self.fail_decode_call: int | None = None  # the index of a decode call that raises
        self.fail_prefill_call: int | None = None  # ... of a prefill call
        self.fail_insert_call: int | None = None  # ... of an insert
        self.fail_extract_calls: set[int] = set()  # ... of extracts
        self.landing_polls = 0  # a received handle is not ready for this many is_ready() calls
        self.fail_recover = False  # recover() raises: the device cannot be rebuilt
        self.poison: dict[int, int] = {}  # decode call index -> a slot whose token is garbage
        self.decode_calls = 0
        self.split_steps = 0  # decode steps run in two halves (decode_forward, decode_sample)
        self.verify_calls = 0
        self.verified: list[tuple[int, int, int]] = []  # (slot, drafts, tokens emitted) per row
        self.verify_rows: list[tuple[int, int, int]] = []  # (slot, first position, drafts) per row
        self._forward: tuple | None = None  # a decode_forward awaiting its decode_sample
        self.prefill_calls = 0
        self.extracts = 0
        self.inserts = 0
        self.recoveries = 0
        self.log: list[Prefill | Decode] = []
        self.copies: list[tuple[int, int]] = []
        self.histories: list[tuple[int, list[int], list[int]]] = []
        # Pages that must not be written (the prefix cache's published pages, when a test
        # hands it in): a write to one is a sequence overwriting KV that others read.
        self.frozen = lambda page: False

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def recover(self) -> None:
        """Like the engine's: every page's contents are gone, whatever state they were in."""
        if self.fail_recover:
            raise RuntimeError("device unreachable")
        self.recoveries += 1
        self._forward = None
        self.pool[:] = -1
        self.last_tokens[:] = 0

    def _write(self, pages, start: int, tokens) -> None:
        size = self.config.page_size
        for i, token in enumerate(tokens):
            p = start + i
            assert not self.frozen(int(pages[p // size])), f"a write into published page {pages[p // size]}"
            assert int(pages[p // size]) != NULL_PAGE, "a write into the null page"
            self.pool[pages[p // size], p % size] = token

    def _content(self, pages, end: int) -> np.ndarray:
        """The sequence's token ids at positions [0, end)."""
        size = self.config.page_size
        return np.asarray([self.pool[pages[p // size], p % size] for p in range(end)], np.int64)

    def next_token(self, content: Sequence[int], seed: int | None = None) -> int:
        """The "model": a pure function of the token ids a sequence holds at [0, pos], and of
        the request's seed when it samples (temperature > 0: pass its seed, else None)."""
        if self.script:
            content_t = tuple(int(t) for t in content)
            for prompt, tokens in self.script.items():
                i = len(content_t) - len(prompt)
                if 0 <= i < len(tokens) and content_t[: len(prompt)] == prompt:
                    return tokens[i]
        h = zlib.crc32(np.asarray(content, np.int64).tobytes())
        if seed is not None:
            h = zlib.crc32(seed.to_bytes(4, "little"), h)
        if self.eos_one_in and h % self.eos_one_in == 0:
            return EOS
        if self.quoting and h % 3 and len(content) > 1:
            before = np.flatnonzero(np.asarray(content[:-1]) == content[-1])
            if before.size:
                return int(content[before[-1] + 1])
        return ALPHABET[(h // 7) % len(ALPHABET)]

    def pick(self, content: Sequence[int], seed: int | None, allowed: np.ndarray | None,
             masked: frozenset[int] = frozenset()) -> int:
        """`next_token`, among the ids a bitmask row `allowed` allows (None: any): the model's
        own token where allowed, else one of the allowed ids chosen by the content's hash.
        `masked`: ids its sampling row biases to -inf (min_tokens), never picked: the model's
        own token then gives way to the alphabet's next one."""
        token = self.next_token(content, seed)
        while token in masked:
            token = ALPHABET[(ALPHABET.index(token) + 1) % len(ALPHABET)] if token in ALPHABET else ALPHABET[0]
        if allowed is None:
            return token
        bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")[: self.vocab_size]
        ids = np.flatnonzero(bits)
        assert ids.size, "a bitmask that allows no token reached the engine"
        if bits[token]:
            return token
        return int(ids[zlib.crc32(np.asarray(content, np.int64).tobytes()) % ids.size])

    def prefill(self, chunks, sampling, allowed=None) -> PrefillTokens:
        """Like the engine's packed program: every chunk's tokens are written before any
        chunk's next token is read, so a page shared by two sequences shows."""
        s = self.config.num_slots
        assert chunks, "a prefill call with no chunk"
        if self.fail_prefill_call == self.prefill_calls + 1:
            self.prefill_calls += 1
            raise RuntimeError("device lost in prefill")
        assert isinstance(sampling, SamplingParams) and sampling.temperature.shape == (s,)
        assert self._forward is None, "a prefill between a decode step's halves"
        for c in chunks:
            n = len(c.tokens)
            assert 0 <= c.slot < s, c.slot
            assert 0 < n <= self.config.prefill_chunk, n
            assert 0 <= c.start and c.start + n <= self.config.max_seq_len, (c.start, n)
            assert all(0 <= t < self.model_config.vocab_size for t in c.tokens)
            assert len(c.pages) >= self.config.pages_for(c.start + n), (len(c.pages), c.start + n)
            self.log.append(Prefill(c.slot, c.start, n, bool(c.final)))
            self._write(c.pages, c.start, c.tokens)
        tokens = np.zeros(len(chunks), np.int32)
        for i, c in enumerate(chunks):
            seed = int(sampling.seed[c.slot]) if sampling.temperature[c.slot] > 0 else None
            tokens[i] = self.pick(self._content(c.pages, c.start + len(c.tokens)), seed,
                                  None if allowed is None else allowed[c.slot], masked(sampling, c.slot))
            if c.final:
                self.last_tokens[c.slot] = tokens[i]
        self.prefill_calls += 1
        return PrefillTokens([(self._later(tokens, chunks, 0), len(chunks))])

    def _later(self, tokens: np.ndarray, chunks: list, decode_rows: int):
        """`tokens`, or with `device_seconds` those tokens when the program would be done."""
        if self.device_seconds is None:
            return tokens
        self._device_free = (max(time.monotonic(), self._device_free)
                             + self.device_seconds(chunks, decode_rows))
        return Later(tokens, self._device_free)

    def decode(self, positions, active, sampling, page_table, steps=1) -> np.ndarray:
        """Like the engine's: `steps` steps, a slot ending at one of its stop ids (and writing
        nothing from then on, nor when it comes in with one)."""
        s = self.config.num_slots
        assert positions.shape == (s,) and active.shape == (s,) and active.dtype == bool
        assert page_table.shape == (s, self.config.max_pages_per_seq)
        assert isinstance(sampling, SamplingParams) and sampling.temperature.shape == (s,)
        assert active.any(), "a decode step with no active slot"
        assert 1 <= steps <= self.config.decode_steps, steps
        assert self._forward is None, "a decode step between another's halves"
        if self.decode_delay:
            time.sleep(self.decode_delay)
        self.decode_calls += 1
        if self.fail_decode_call == self.decode_calls:
            raise RuntimeError("device lost in decode")
        slots = tuple(int(i) for i in np.flatnonzero(active))
        self.log.append(Decode(slots, tuple(int(positions[i]) for i in slots), steps))
        # Inactive slots, and steps after a slot's end: garbage the scheduler must not read.
        tokens = np.full((steps, s), -1, np.int32)
        for i in slots:
            for step in range(steps):
                if self.last_tokens[i] in sampling.stop_ids[i]:
                    break
                p = int(positions[i]) + step
                assert 0 <= p < self.config.max_seq_len, p
                self._write(page_table[i], p, [self.last_tokens[i]])
                seed = int(sampling.seed[i]) if sampling.temperature[i] > 0 else None
                tokens[step, i] = self.last_tokens[i] = self.pick(
                    self._content(page_table[i], p + 1), seed, None, masked(sampling, i))
        if self.decode_calls in self.poison:
            tokens[0, self.poison[self.decode_calls]] = 2**31 - 1  # no such token
        return self._later(tokens, [], len(slots))

    def verify(self, positions, active, sampling, page_table, drafts, draft_lens,
               allowed=None) -> DecodeTokens:
        """Like the engine's: each row's last token and drafts written at its next positions,
        then the "model"'s token at each (among those its bitmask there allows), kept while it
        equals the draft (and not a stop id)."""
        s, k = self.config.num_slots, self.config.speculative_tokens
        assert k > 0 and drafts.shape == (s, k) and draft_lens.shape == (s,)
        assert allowed is None or (allowed.dtype == np.int32 and
                                   allowed.shape == (s, k + 1, bitmask_words(self.vocab_size)))
        assert positions.shape == (s,) and active.any() and page_table.shape[0] == s
        assert np.count_nonzero(active) <= self.config.speculative_batch
        assert self._forward is None, "a verify step between a decode step's halves"
        self.decode_calls += 1
        self.verify_calls += 1
        if self.fail_decode_call == self.decode_calls:
            raise RuntimeError("device lost in verify")
        slots = tuple(int(i) for i in np.flatnonzero(active))
        self.log.append(Decode(slots, tuple(int(positions[i]) for i in slots), 1))
        tokens = np.full((k + 1, s), -1, np.int32)
        emitted = np.zeros(s, np.int32)
        for i in slots:
            if self.last_tokens[i] in sampling.stop_ids[i]:
                continue
            p, d = int(positions[i]), int(draft_lens[i])
            assert 0 <= p and p + d < self.config.max_seq_len, (p, d)
            assert all(0 <= t < self.vocab_size for t in drafts[i, :d])
            self._write(page_table[i], p, [self.last_tokens[i], *drafts[i, :d]])
            seed = int(sampling.seed[i]) if sampling.temperature[i] > 0 else None
            for j in range(d + 1):
                tokens[j, i] = self.last_tokens[i] = self.pick(
                    self._content(page_table[i], p + j + 1), seed, None if allowed is None else allowed[i, j],
                    masked(sampling, i))
                emitted[i] += 1
                if j == d or tokens[j, i] != drafts[i, j] or tokens[j, i] in sampling.stop_ids[i]:
                    break
            self.verified.append((i, d, int(emitted[i])))
            self.verify_rows.append((i, p, d))
        return DecodeTokens(tokens, k + 1, None, emitted)

    def decode_forward(self, positions, active, sampling, page_table) -> None:
        """Like the engine's: the KV of one step written, its sampling left to decode_sample."""
        s = self.config.num_slots
        assert positions.shape == (s,) and active.any() and page_table.shape[0] == s
        assert self._forward is None, "decode_forward twice"
        slots = tuple(int(i) for i in np.flatnonzero(active))
        self.log.append(Decode(slots, tuple(int(positions[i]) for i in slots), 1))
        live = [i for i in slots if self.last_tokens[i] not in sampling.stop_ids[i]]
        for i in live:
            self._write(page_table[i], int(positions[i]), [self.last_tokens[i]])
        self._forward = (positions, live, sampling, page_table.copy())

    def decode_sample(self, allowed, drop=()) -> np.ndarray:
        """Like the engine's: each live row's token among those its bitmask allows; the rows of
        `drop` take none."""
        assert self._forward is not None, "decode_sample without decode_forward"
        positions, live, sampling, page_table = self._forward
        self._forward = None
        self.decode_calls += 1
        self.split_steps += 1
        if self.fail_decode_call == self.decode_calls:
            raise RuntimeError("device lost in decode")
        assert allowed.dtype == np.int32 and allowed.shape == (self.config.num_slots, bitmask_words(self.vocab_size))
        tokens = np.full((1, self.config.num_slots), -1, np.int32)
        for i in live:
            if i in drop:
                continue
            seed = int(sampling.seed[i]) if sampling.temperature[i] > 0 else None
            tokens[0, i] = self.last_tokens[i] = self.pick(
                self._content(page_table[i], int(positions[i]) + 1), seed, allowed[i], masked(sampling, i))
        return tokens

    def copy_pages(self, sources, targets) -> None:
        """Like the engine's: each target page's contents become its source's."""
        assert len(sources) == len(targets) <= self.config.num_slots
        for source, target in zip(sources, targets):
            assert not self.frozen(int(target)), f"a copy onto published page {target}"
            assert (self.pool[source][:1] >= 0).all(), f"a copy of page {source}, never written"
            self.pool[target] = self.pool[source]
            self.copies.append((int(source), int(target)))

    def set_history(self, slot, prompt_ids, output_ids=(), window=0, dry_breakers=None,
                    sampler_state=(0.0,) * SAMPLER_STATE) -> None:
        # The fake "model" has no penalties; recorded so tests can see when it is set.
        self.histories.append((slot, list(prompt_ids), list(output_ids)))

    def sampler_state(self, slot) -> np.ndarray:
        assert 0 <= slot < self.config.num_slots
        return np.zeros(SAMPLER_STATE, np.float32)  # (no sampler of its own carries state)

    def extract(self, pages, length, slot) -> FakeHandle:
        assert 0 <= slot < self.config.num_slots and 0 < length <= self.config.max_seq_len
        assert len(pages) >= self.config.pages_for(length)
        self.extracts += 1
        if self.extracts in self.fail_extract_calls:
            raise RuntimeError("device lost in extract")
        return FakeHandle(self._content(pages, length).copy(), int(self.last_tokens[slot]), length,
                          self.config.page_size)

    def receive(self, handle: FakeHandle) -> FakeHandle:
        return dataclasses.replace(handle, polls=self.landing_polls)

    def insert(self, handle: FakeHandle, pages, slot) -> FakeHandle:
        """Like the engine's: the content lands in `pages`, the next token in `slot`."""
        assert slot is None or 0 <= slot < self.config.num_slots
        assert len(pages) >= self.config.pages_for(handle.length), (len(pages), handle.length)
        self.inserts += 1
        if self.fail_insert_call == self.inserts:
            raise RuntimeError("device lost in insert")
        assert (handle.content >= 0).all(), "a handle of KV that was never written"
        self._write(pages, 0, handle.content)
        if slot is not None:  # (None: pages alone, a prefix back from the host)
            self.last_tokens[slot] = handle.next_token
        return handle


@dataclasses.dataclass
class FakeHandle:
    """A FakeEngine's KVHandle: the sequence's token ids and the token it decodes next."""

    content: np.ndarray
    next_token: int
    length: int
    page_size: int = 0  # (set where pages are taken apart: `host_pages`)
    polls: int = 0  # is_ready() calls that say "not yet"

    @property
    def nbytes(self) -> int:
        return self.content.nbytes

    def block_until_ready(self) -> FakeHandle:
        return self

    def is_ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def to_host_async(self) -> None:
        pass

    def host_pages(self) -> list[tuple[np.ndarray]]:
        """Like `KVHandle.host_pages`: each live page's token ids."""
        size = self.page_size
        return [(self.content[i * size : (i + 1) * size].copy(),) for i in range(-(-self.length // size))]

    @classmethod
    def from_host_pages(cls, pages, page_size: int, width: int) -> FakeHandle:
        return cls(np.concatenate([content for content, in pages]), -1, len(pages) * page_size, page_size)


def expected(engine: FakeEngine, prompt: Sequence[int], max_tokens: int,
             ignore_eos: bool = False, sampling: RequestSampling = RequestSampling(),
             min_tokens: int = 0) -> tuple[list[int], str]:
    """What one request must produce: the model run sequentially on prompt + its own output
    (its EOS masked for the first `min_tokens`)."""
    seed = sampling.seed if sampling.temperature > 0 else None
    content, out = list(prompt), []
    while len(out) < max_tokens:
        masking = len(out) < min_tokens and not ignore_eos
        token = engine.pick(content, seed, None, frozenset(TOK.eos_ids) if masking else frozenset())
        out.append(token)
        if token == EOS and not ignore_eos:
            return out, "stop"
        content.append(token)
    return out, "length"


# --- a synchronous driver ---------------------------------------------------------------------


class Client:
    """One stream's events, each with the index of the step that delivered it."""

    def __init__(self, stream: RequestStream, prompt: list[int], params: GenerationParams):
        self.stream, self.prompt, self.params = stream, prompt, params
        self.events: list[tuple[int, TokenEvent]] = []
        # PromptProgress events (`GenerationParams.progress`): step, tokens events before it, event
        self.progress: list[tuple[int, int, PromptProgress]] = []
        self.record: RequestRecord | None = None

    def poll(self, step: int) -> None:
        # Synchronous driving: events are already queued when step() returns; read without
        # blocking (iterating the stream would block until the request ends).
        while not self.stream._queue.empty():
            event = self.stream._queue.get_nowait()
            if isinstance(event, RequestRecord):
                assert self.record is None, "two records for one request"
                self.record = event
            else:
                assert self.record is None, "an event after the record"
                if isinstance(event, PromptProgress):
                    self.progress.append((step, len(self.events), event))
                else:
                    self.events.append((step, event))

    @property
    def slot(self) -> int:
        return self.stream.request.slot

    @property
    def token_ids(self) -> list[int]:
        return [t for _, e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for _, e in self.events)

    @property
    def first_token_step(self) -> int:
        return self.events[0][0]

    def check(self, engine: FakeEngine) -> None:
        """Output ids, finish reason, text and record agree with the sequential simulation
        (an aborted request: its output is a prefix of the simulated one)."""
        assert self.record is not None, "the request never finished"
        want, reason = expected(engine, self.prompt, self.stream.request.max_tokens,
                                self.params.ignore_eos, self.params.sampling, self.params.min_tokens)
        if self.record.finish_reason == "abort":
            want = want[: len(self.token_ids)]
        else:
            assert self.record.finish_reason == reason
        assert self.token_ids == want
        assert self.record.output_tokens == len(want)
        assert self.text == self.record.text == TOK.decode([t for t in want if t != EOS])


class Harness:
    """A scheduler over a FakeEngine, stepped by hand; keeps each step's engine calls."""

    def __init__(self, engine: FakeEngine, policy: PolicyConfig | None = None, max_queue: int = 256,
                 decode_engine: FakeEngine | None = None, **config):
        self.engine = engine  # prefills (and decodes, without decode_engine)
        self.decode_engine = decode_engine or engine
        policy = policy or PolicyConfig(chunk=engine.config.prefill_chunk)
        self.sched = Scheduler(engine, TOK, SchedulerConfig(policy=policy, max_queue=max_queue, **config),
                               decode_engine=decode_engine)
        self.clients: list[Client] = []
        self.steps: list[list[Prefill | Decode]] = []  # engine calls made by each step

    def submit(self, prompt: Sequence[int], **params) -> Client:
        gp = GenerationParams(**params)
        client = Client(self.sched.submit(list(prompt), gp), list(prompt), gp)
        self.clients.append(client)
        return client

    def submit_group(self, prompt: Sequence[int], params: list[dict]) -> list[Client]:
        gps = [GenerationParams(**p) for p in params]
        streams = self.sched.submit_group(list(prompt), gps, [None] * len(gps))
        clients = [Client(s, list(prompt), gp) for s, gp in zip(streams, gps)]
        self.clients.extend(clients)
        return clients

    def step(self) -> None:
        engines = list(dict.fromkeys((self.engine, self.decode_engine)))
        n = [len(e.log) for e in engines]
        self.sched.step()
        self.steps.append([call for e, i in zip(engines, n) for call in e.log[i:]])
        for c in self.clients:
            c.poll(len(self.steps) - 1)

    def run(self, until=None, max_steps: int = 5000) -> None:
        """Steps until `until()` holds, by default until every request ended and nothing is
        pending."""
        until = until or (lambda: self.sched.idle() and all(c.record for c in self.clients))
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def prefills(self, client: Client) -> list[tuple[int, Prefill]]:
        return [(i, c) for i, calls in enumerate(self.steps) for c in calls
                if isinstance(c, Prefill) and c.slot == client.slot]

    def decode_steps_of(self, client: Client) -> list[int]:
        return [i for i, calls in enumerate(self.steps) for c in calls
                if isinstance(c, Decode) and client.slot in c.slots]


def chunked(budget: int = 256, chunk: int = 64, **kw) -> PolicyConfig:
    return PolicyConfig(name="chunked", token_budget=budget, chunk=chunk, **kw)


def prefill_first(chunk: int = 64) -> PolicyConfig:
    return PolicyConfig(name="prefill-first", chunk=chunk)


def collect(stream: RequestStream, timeout: float = 5) -> tuple[list[int], RequestRecord]:
    """Reads a stream from a plain thread, with a deadline so a hang fails instead."""
    out: list = []
    reader = threading.Thread(target=lambda: out.extend(stream), daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), "the stream did not end"
    *events, record = out
    assert isinstance(record, RequestRecord)
    return [t for e in events for t in e.token_ids], record


def run_random_load(h: Harness, rng, arrivals: list[int], prompt_max: int, tokens_max: int,
                    cancel_p: float, max_steps: int, after_step=lambda: None, prompt=None) -> None:
    """Submits a request at each arrival step (random prompt up to `prompt_max` tokens, or one
    `prompt(rng)` draws; up to `tokens_max` output; greedy or seeded sampling), cancels a live
    one with probability `cancel_p` per step, and steps until everything has arrived and the
    scheduler is idle (within `max_steps`)."""
    prompt = prompt or (lambda rng: random_prompt(rng, int(rng.integers(1, prompt_max))))
    for step in range(max_steps):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            sampling = RequestSampling(temperature=float(rng.choice([0.0, 0.8])),
                                       seed=int(rng.integers(0, 2**31)))
            h.submit(prompt(rng), max_tokens=int(rng.integers(1, tokens_max)), sampling=sampling)
        live = [c for c in h.clients if c.record is None]
        if live and rng.random() < cancel_p:
            live[int(rng.integers(len(live)))].stream.cancel()
        if not arrivals and h.sched.idle():
            return
        h.step()
        after_step()
    raise AssertionError(f"the load did not finish in {max_steps} steps")


def all_pages_free(h: Harness) -> None:
    assert h.sched.kv_pages == (0, h.engine.num_pages)
    assert not h.sched.pools[0].tables.any()


# --- driving a real engine's scheduler ------------------------------------------------------


needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def make_scheduler(engine, tokenizer, policy="chunked", chunk=64, budget=96, draft_engine=None) -> Scheduler:
    cfg = SchedulerConfig(policy=PolicyConfig(name=policy, token_budget=budget, chunk=chunk))
    return Scheduler(engine, tokenizer, cfg, draft_engine=draft_engine)


def run_all(sched: Scheduler, submissions, arrival_steps=None) -> list[RequestStream]:
    """Submits (prompt_ids, params) pairs at given iteration indices and steps to the end.

    Checks that each stream's events carry exactly the request's output tokens."""
    arrival_steps = arrival_steps or [0] * len(submissions)
    streams, step, pending = [None] * len(submissions), 0, list(range(len(submissions)))
    while pending or not sched.idle():
        for i in [i for i in pending if arrival_steps[i] <= step]:
            streams[i] = sched.submit(*submissions[i])
            pending.remove(i)
        sched.step()
        step += 1
    for s in streams:
        events = list(s)
        assert isinstance(events[-1], RequestRecord)
        assert [e.token_ids[0] for e in events[:-1]] == s.request.output_ids
    return streams


def random_prompts(rng: random.Random, n: int, vocab: int, lo=1, hi=150):
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
