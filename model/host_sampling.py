"""Sampling's host side: one request's settings, the per-slot rows they pack into, and the
layout of token bitmasks (NumPy only, no JAX).

    sampling = RequestSampling(temperature=0.8, top_p=0.95, seed=7)   # validated when made
    rows = SamplingRows(num_slots); rows.set(slot, sampling, stop_ids=eos_ids)
    rows.params()                     # `SamplingParams`: the rows as the programs take them
    allowed = all_allowed(num_slots, vocab)     # [num_slots, bitmask_words(vocab)] int32
    gather_allowed(allowed, (num_slots,), vocab, pick, live)   # a batch's rows of them

A request's settings are checked here, against what the per-row device arrays can hold, so a
value that cannot be packed is refused at the edge and never reaches a batch shared with other
requests. The scheduler and the front doors use these types without importing JAX. The packed
rows' type, `SamplingParams`, is a NamedTuple of arrays: NumPy here, device arrays inside a
program (JAX takes a NamedTuple as a pytree as it is). The device-side sampling that reads
them (`TokenHistory`, `choose`) is `model.sampling`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from cadence.model.arith import cdiv


# What the device arrays can hold: top_k is int32 and the seed uint32 (`SamplingParams`).
MAX_TOP_K = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
SEED_RANGE = 2**32
# Stop token ids a row carries to the device. A request with more EOS ids than this is still
# stopped by the host on every one of them; the device just runs its surplus steps.
MAX_STOP_TOKENS = 8
# logit_bias entries per request (OpenAI's limit); a row's unused entries hold NO_TOKEN, an id
# past any vocabulary, which the scatter that applies them drops.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
NO_TOKEN = 2**31 - 1
# OpenAI's range for presence_penalty and frequency_penalty; vLLM's for repetition_penalty.
PENALTY_RANGE = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_PENALTY_WINDOW = 2**31 - 1  # int32's: a window past the sequence holds all of it
# llama.cpp's samplers' settings, a row array each (`SamplingRows`).
LLAMA_SAMPLERS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                  "dynatemp_exponent", "temperature_last", "dry_multiplier", "dry_base",
                  "dry_allowed_length", "dry_window", "mirostat", "mirostat_tau", "mirostat_eta",
                  "adaptive_target", "adaptive_decay")
# What a row's stateful sampler carries from one token to the next (`TokenHistory.sampler`):
# Mirostat's mu (and nothing), or adaptive-p's decayed sum of the drawn tokens' probabilities
# and the sum of its weights.
SAMPLER_STATE = 2
MAX_ADAPTIVE_DECAY = 0.99  # llama.cpp's: a history of at most ~100 tokens
# DRY's sequence breakers: the token ids a request's slot holds (`TokenHistory.set_row`).
MAX_DRY_BREAKERS = 8192
# Mirostat's target surprise, in bits: past float32's exponent 2 ** mu overflows.
MAX_MIROSTAT_TAU = 60.0


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """Host-side sampling settings of one request, validated when it is made.

    Every value must fit the per-row device arrays it is packed into; a value that does not
    (a non-finite temperature, a top_k past int32) is refused here, at the edge, so it can never
    reach a batch where it would fail the requests beside it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, ids distinct; whether an id is in the vocabulary is the
    # scheduler's check (it knows the model).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # 0: the penalties over the whole history, as OpenAI's and HF's (presence and frequency
    # over the output, repetition over prompt and output); n > 0: llama.cpp's (its
    # repeat_last_n), all three over the last n tokens of prompt and output.
    penalty_window: int = 0
    # LoRA adapters (`model.lora`): (slot in the engine's bank, scale) pairs, slots distinct;
    # whether the engine's bank has the slot is `SamplingRows.set`'s check (it knows its size).
    lora: tuple[tuple[int, float], ...] = ()
    # llama.cpp's samplers (`model.sampling.kept`): typical_p 1, top_n_sigma 0, xtc_probability
    # 0 and dynatemp_range 0 are off. XTC takes out, with xtc_probability, every token at least
    # xtc_threshold likely but the least likely of them (off above 0.5, as there).
    typical_p: float = 1.0
    top_n_sigma: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # True: llama.cpp's order, the filters on the unscaled logits and the temperature (dynamic
    # or not) last; False: vLLM's, the temperature first.
    temperature_last: bool = False
    # llama.cpp's DRY ("don't repeat yourself", `model.sampling.TokenHistory`): a token that
    # would extend a repetition of at least dry_allowed_length tokens within the last
    # dry_window loses dry_multiplier x dry_base ** (its length - dry_allowed_length) of its
    # logit; a repetition does not reach back past the last of the dry_breakers (token ids,
    # which are never penalized themselves). dry_multiplier 0: off.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_window: int = 64
    dry_breakers: tuple[int, ...] = ()
    # llama-server's post_sampling_probs: the request's logprobs (where it asks) are of the
    # distribution its token was drawn from, after every filter and the temperature.
    post_sampling: bool = False
    # llama.cpp's Mirostat (`model.sampling.mirostat`): 1 or 2 (0: off) draws from the tokens
    # whose surprise (-log2 p) keeps the text's average surprise near mirostat_tau bits, its
    # bound mu (2 tau at first) moved by mirostat_eta x each token's error. It replaces the
    # filters: a request on it is sampled as llama-server samples one (logit_bias, the
    # temperature, Mirostat), its other samplers and penalties off.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # llama.cpp's adaptive-p (`model.sampling.adaptive`), at adaptive_target in [0, 1]
    # (negative: off): the draw, last in llama.cpp's order, favours the tokens whose probability
    # is near a target, adapted so that the drawn tokens' probabilities average adaptive_target
    # over ~1 / (1 - adaptive_decay) of them.
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9

    @property
    def stateful(self) -> bool:
        """Whether the request's sampler carries state from token to token (Mirostat's mu,
        adaptive-p's average: `TokenHistory.sampler`), which a slot's history is written with."""
        return self.mirostat != 0 or self.adaptive_target >= 0

    @property
    def sampler_state(self) -> tuple[float, ...]:
        """A stateful sampler's state before the request's first token (`SAMPLER_STATE`):
        Mirostat's 2 tau; adaptive-p's average at its target, with the weight of a full history."""
        if self.adaptive_target >= 0:
            return (self.adaptive_target / (1 - self.adaptive_decay), 1 / (1 - self.adaptive_decay))
        return (2 * self.mirostat_tau, 0.0)

    @property
    def penalized(self) -> bool:
        """Whether the request's logits depend on its token history (`TokenHistory`)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.dry_multiplier != 0)

    @property
    def history_settings(self) -> tuple[int, tuple[int, ...] | None]:
        """What a penalized request's slot history is written with (`set_history`'s window
        and dry_breakers): its penalty_window, and its DRY breakers (None: not on DRY)."""
        return self.penalty_window, self.dry_breakers if self.dry_multiplier else None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "typical_p", "top_n_sigma", "xtc_probability",
                     "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "dry_multiplier",
                     "dry_base", "mirostat_tau", "mirostat_eta", "adaptive_target", "adaptive_decay"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or abs(value) > FLOAT32_MAX):
                raise ValueError(f"{name} must be a finite number that fits float32, got {value!r}")
        for name in ("top_k", "seed", "penalty_window", "dry_allowed_length", "dry_window", "mirostat"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.penalty_window <= MAX_PENALTY_WINDOW:
            raise ValueError(f"penalty_window must be in [0, {MAX_PENALTY_WINDOW}] (0: the whole "
                             f"history), got {self.penalty_window}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 "
                             f"disables it), got {self.repetition_penalty}")
        for name, low, high in (("typical_p", 0.0, 1.0), ("xtc_probability", 0.0, 1.0),
                                ("xtc_threshold", 0.0, 1.0)):
            value = getattr(self, name)
            if not (low < value <= high if name == "typical_p" else low <= value <= high):
                bounds = f"({low:g}, {high:g}]" if name == "typical_p" else f"[{low:g}, {high:g}]"
                raise ValueError(f"{name} must be in {bounds}, got {value}")
        for name in ("top_n_sigma", "dynatemp_range", "dynatemp_exponent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dry_multiplier < 0 or self.dry_base < 1:
            raise ValueError(f"dry_multiplier must be >= 0 and dry_base >= 1, got {self.dry_multiplier} "
                             f"and {self.dry_base}")
        for name in ("dry_allowed_length", "dry_window"):
            if not 0 <= getattr(self, name) <= MAX_PENALTY_WINDOW:
                raise ValueError(f"{name} must be in [0, {MAX_PENALTY_WINDOW}], got {getattr(self, name)}")
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}")
        if not 0 <= self.mirostat_tau <= MAX_MIROSTAT_TAU:
            raise ValueError(f"mirostat_tau must be in [0, {MAX_MIROSTAT_TAU:g}] (bits), got {self.mirostat_tau}")
        if not self.mirostat_eta >= 0:
            raise ValueError(f"mirostat_eta must be >= 0, got {self.mirostat_eta}")
        if self.adaptive_target > 1:
            raise ValueError(f"adaptive_target must be at most 1 (negative: off), got {self.adaptive_target}")
        if not 0 <= self.adaptive_decay <= MAX_ADAPTIVE_DECAY:
            raise ValueError(f"adaptive_decay must be in [0, {MAX_ADAPTIVE_DECAY}], got {self.adaptive_decay}")
        if self.mirostat and self.adaptive_target >= 0:
            raise ValueError("mirostat and adaptive_target replace the same draw: one of them at most")
        breakers = self.dry_breakers
        if (not isinstance(breakers, tuple) or len(breakers) > MAX_DRY_BREAKERS or len(set(breakers)) != len(breakers)
                or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < NO_TOKEN
                           for t in breakers)):
            raise ValueError(f"dry_breakers must be a tuple of at most {MAX_DRY_BREAKERS} distinct token ids")
        for name in ("temperature_last", "post_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_logit_bias(self.logit_bias)
        _check_lora(self.lora)


def _check_lora(lora) -> None:
    if not isinstance(lora, tuple) or not all(isinstance(e, tuple) and len(e) == 2 for e in lora):
        raise ValueError(f"lora must be a tuple of (adapter slot, scale) pairs, got {lora!r}")
    slots = [slot for slot, _ in lora]
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in slots):
        raise ValueError(f"lora's adapter slots are integers >= 0, got {slots}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"lora names an adapter twice: {slots}")
    for slot, scale in lora:
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                or abs(scale) > FLOAT32_MAX):
            raise ValueError(f"lora scales are finite numbers that fit float32, got {scale!r} for adapter {slot}")


def _check_logit_bias(bias) -> None:
    if not isinstance(bias, tuple):
        raise ValueError(f"logit_bias must be a tuple of (token id, bias) pairs, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    seen = set()
    for entry in bias:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"logit_bias entries are (token id, bias) pairs, got {entry!r}")
        token, value = entry
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < NO_TOKEN:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if token in seen:
            raise ValueError(f"logit_bias names token {token} twice")
        seen.add(token)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {value!r} for token {token}")


def row_bias(logit_bias: Iterable[tuple[int, float]], masked: Iterable[int] = ()) -> dict[int, float]:
    """A row's biases: a request's `logit_bias`, and -inf for the ids it must not sample
    (over its own bias for them); ValueError past the row's MAX_LOGIT_BIAS entries."""
    bias = dict(logit_bias) | dict.fromkeys(masked, -np.inf)
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"{len(bias)} biased and masked tokens exceed the row's {MAX_LOGIT_BIAS}")
    return bias


class SamplingRows:
    """Per-slot sampling parameters on the host, in the dtypes the programs take; `lora_slots`:
    the size of the engine's LoRA bank, each row's scale per adapter ([num_slots, lora_slots])."""

    def __init__(self, num_slots: int, lora_slots: int = 0):
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.seed = np.zeros(num_slots, np.uint32)
        self.stop_ids = np.full((num_slots, MAX_STOP_TOKENS), -1, np.int32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.presence_penalty = np.zeros(num_slots, np.float32)
        self.frequency_penalty = np.zeros(num_slots, np.float32)
        self.repetition_penalty = np.ones(num_slots, np.float32)
        self.penalty_window = np.zeros(num_slots, np.int32)
        self.bias_ids = np.full((num_slots, MAX_LOGIT_BIAS), NO_TOKEN, np.int32)
        self.bias_values = np.zeros((num_slots, MAX_LOGIT_BIAS), np.float32)
        self.logprobs = np.zeros(num_slots, bool)
        self.lora = np.zeros((num_slots, lora_slots), np.float32)
        self.typical_p = np.ones(num_slots, np.float32)
        self.top_n_sigma = np.zeros(num_slots, np.float32)
        self.xtc_probability = np.zeros(num_slots, np.float32)
        self.xtc_threshold = np.zeros(num_slots, np.float32)
        self.dynatemp_range = np.zeros(num_slots, np.float32)
        self.dynatemp_exponent = np.ones(num_slots, np.float32)
        self.temperature_last = np.zeros(num_slots, bool)
        self.dry_multiplier = np.zeros(num_slots, np.float32)
        self.dry_base = np.ones(num_slots, np.float32)
        self.dry_allowed_length = np.zeros(num_slots, np.int32)
        self.dry_window = np.zeros(num_slots, np.int32)
        self.post_sampling = np.zeros(num_slots, bool)
        self.mirostat = np.zeros(num_slots, np.int32)
        self.mirostat_tau = np.zeros(num_slots, np.float32)
        self.mirostat_eta = np.zeros(num_slots, np.float32)
        self.adaptive_target = np.full(num_slots, -1.0, np.float32)
        self.adaptive_decay = np.zeros(num_slots, np.float32)

    @classmethod
    def of(cls, rows: list[RequestSampling], lora_slots: int = 0) -> SamplingRows:
        packed = cls(len(rows), lora_slots)
        for slot, row in enumerate(rows):
            packed.set(slot, row)
        return packed

    def set(self, slot: int, sampling: RequestSampling, stop_ids: Iterable[int] = (),
            logprobs: bool = False, masked: Iterable[int] = ()) -> None:
        """Packs one row (the first MAX_STOP_TOKENS of `stop_ids`, and whether its request
        wants logprobs); `masked`: token ids it must not sample (a bias of -inf, over its own
        bias for them: min_tokens). Raises (and changes nothing) if a value does not fit its
        dtype, or the biases their MAX_LOGIT_BIAS entries."""
        values = (np.float32(sampling.temperature), np.int32(sampling.top_k),
                  np.float32(sampling.top_p), np.uint32(sampling.seed))
        stops = np.full(MAX_STOP_TOKENS, -1, np.int32)
        ids = list(stop_ids)[:MAX_STOP_TOKENS]
        stops[: len(ids)] = np.asarray(ids, np.int32)
        bias = row_bias(sampling.logit_bias, masked)
        bias_ids = np.full(MAX_LOGIT_BIAS, NO_TOKEN, np.int32)
        bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
        if bias:
            bias_ids[: len(bias)], bias_values[: len(bias)] = zip(*bias.items())
        lora = np.zeros(self.lora.shape[1], np.float32)
        for adapter, scale in sampling.lora:
            if adapter >= len(lora):
                raise ValueError(f"LoRA adapter {adapter} is past the engine's {len(lora)} adapter slots")
            lora[adapter] = scale
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.seed[slot] = values
        self.stop_ids[slot] = stops
        self.min_p[slot] = sampling.min_p
        self.presence_penalty[slot] = sampling.presence_penalty
        self.frequency_penalty[slot] = sampling.frequency_penalty
        self.repetition_penalty[slot] = sampling.repetition_penalty
        self.penalty_window[slot] = sampling.penalty_window
        self.bias_ids[slot], self.bias_values[slot] = bias_ids, bias_values
        self.logprobs[slot] = logprobs
        self.lora[slot] = lora
        for name in LLAMA_SAMPLERS:
            getattr(self, name)[slot] = getattr(sampling, name)
        self.post_sampling[slot] = sampling.post_sampling

    def clear(self, slot: int) -> None:
        """Greedy again: a free slot must not make a step take the sampling path."""
        self.set(slot, RequestSampling())

    def params(self) -> SamplingParams:
        """The rows as the programs take them."""
        # Copies: JAX may alias host buffers on the CPU, and these arrays change next step.
        return SamplingParams(*(getattr(self, name).copy() for name in SamplingParams._fields))


class SamplingParams(NamedTuple):
    """Every slot's sampling row, one array per setting ([rows], the stop ids [rows,
    MAX_STOP_TOKENS], the logit biases [rows, MAX_LOGIT_BIAS], the LoRA scales [rows,
    lora_slots]): NumPy as `SamplingRows.params` packs them, device arrays inside a program.
    Its methods work on either."""

    temperature: Any
    top_k: Any
    top_p: Any
    seed: Any
    stop_ids: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    penalty_window: Any
    bias_ids: Any
    bias_values: Any
    logprobs: Any
    lora: Any
    typical_p: Any
    top_n_sigma: Any
    xtc_probability: Any
    xtc_threshold: Any
    dynatemp_range: Any
    dynatemp_exponent: Any
    temperature_last: Any
    dry_multiplier: Any
    dry_base: Any
    dry_allowed_length: Any
    dry_window: Any
    post_sampling: Any
    mirostat: Any
    mirostat_tau: Any
    mirostat_eta: Any
    adaptive_target: Any
    adaptive_decay: Any

    @classmethod
    def greedy(cls, rows: int) -> SamplingParams:
        return cls.make([0.0] * rows, [0] * rows, [1.0] * rows, [0] * rows)

    @classmethod
    def make(cls, temperature, top_k, top_p, seed) -> SamplingParams:
        """Rows with these values and every other setting off (tests' shorthand)."""
        rows = SamplingRows.of([RequestSampling()] * len(temperature))
        rows.temperature[:] = temperature
        rows.top_k[:] = top_k
        rows.top_p[:] = top_p
        rows.seed[:] = seed
        return rows.params()

    @property
    def penalized(self):
        """[rows] bool: whether a row's logits depend on its token history."""
        return ((self.presence_penalty != 0) | (self.frequency_penalty != 0)
                | (self.repetition_penalty != 1) | (self.dry_multiplier != 0))

    @property
    def drawn(self):
        """[rows] bool: whether a row draws its token at random: a temperature above 0, or
        llama.cpp's dynamic temperature (which that order applies whatever the temperature)."""
        return (self.temperature > 0) | (self.temperature_last & (self.dynatemp_range > 0))

    @property
    def filtered(self):
        """[rows] bool: whether a row's token depends on the filters (`model.sampling.kept`): a
        drawn row, or a greedy one in llama.cpp's order whose typical_p or XTC may take out the
        likeliest token (its token is then the likeliest of those left); a stateful row, whose
        state moves with every token, greedy or not."""
        return (self.drawn | (self.temperature_last & ((self.typical_p < 1) | (self.xtc_probability > 0)))
                | self.stateful)

    @property
    def stateful(self):
        """[rows] bool: whether a row's sampler carries state from token to token (Mirostat,
        adaptive-p: `model.sampling.TokenHistory.sampler`)."""
        return (self.mirostat != 0) | (self.adaptive_target >= 0)

    def stops(self, tokens):
        """[rows] bool: whether each row's token ends its request."""
        return (tokens[:, None] == self.stop_ids).any(axis=-1)


def dry_matches(sequence: np.ndarray) -> np.ndarray:
    """[n] int32 for a sequence of n tokens: at each position k before the last, how many
    tokens the sequence up to k and the whole sequence end alike (DRY's repetitions,
    `TokenHistory.match`); 0 at the last. The Z-algorithm over the sequence reversed, O(n)."""
    r = np.asarray(sequence)[::-1].tolist()
    n = len(r)
    z = [0] * n
    lo = hi = 0  # the rightmost window [lo, hi) known to repeat the start
    for i in range(1, n):
        k = min(z[i - lo], hi - i) if i < hi else 0
        while i + k < n and r[k] == r[i + k]:
            k += 1
        z[i] = k
        if i + k > hi:
            lo, hi = i, i + k
    return np.asarray(z[::-1], np.int32)  # z[n - 1 - k] is position k's; z[0] (the last's) is 0


def bitmask_words(vocab: int) -> int:
    """int32 words of one row's token bitmask."""
    return cdiv(vocab, 32)


ALL_ALLOWED = -1  # a bitmask word with every bit set: the row is not constrained


def all_allowed(rows: int | tuple[int, ...], vocab: int) -> np.ndarray:
    """[*rows, bitmask_words(vocab)] int32 bitmasks that allow every token. `rows`: how many,
    or their leading shape (a verify step's [slots, positions])."""
    rows = (rows,) if np.ndim(rows) == 0 else tuple(rows)
    return np.full((*rows, bitmask_words(vocab)), ALL_ALLOWED, np.int32)


def gather_allowed(allowed: np.ndarray | None, rows: tuple[int, ...], vocab: int, pick: np.ndarray,
                   live: np.ndarray) -> np.ndarray:
    """Rows `pick` of the bitmasks `allowed` (int32 [*rows, words]; None: every token
    allowed), those not `live` (a batch's padding) allowing every token."""
    if allowed is None:
        return all_allowed((len(pick), *rows[1:]), vocab)
    shape = (*rows, bitmask_words(vocab))
    if allowed.shape != shape or allowed.dtype != np.int32:
        raise ValueError(f"token bitmasks are int32 {list(shape)}, got {allowed.dtype} "
                         f"{list(allowed.shape)}")
    live = live.reshape(-1, *[1] * (len(shape) - 1))
    return np.where(live, allowed[pick], ALL_ALLOWED).astype(np.int32)

