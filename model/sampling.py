"""On-device sampling with per-row parameters.

    tokens = sample(logits, params)      logits [rows, vocab] float32 -> tokens [rows] int32

Every parameter is an array with one entry per row, so one compiled program serves any mix of
greedy and sampled requests:
    temperature  [rows] f32   0 means greedy (argmax)
    top_k        [rows] i32   0 means no top-k limit
    top_p        [rows] f32   1.0 means no nucleus limit
    seed         [rows] u32   with `step` [rows] i32 gives the row's key: fold_in(key(seed), step)
    stop_ids     [rows, MAX_STOP_TOKENS] i32   token ids that end the row's request (its EOS
                 ids; -1 pads), so a program of several decode steps stops a row on the device
    min_p        [rows] f32   0 means off: drop tokens less likely than min_p x the likeliest
    presence_penalty, frequency_penalty   [rows] f32   0 means off (OpenAI's, over the output)
    repetition_penalty                    [rows] f32   1 means off (HF/vLLM's, prompt + output)
    penalty_window  [rows] i32   0: the penalties as above; n: llama.cpp's, all three over the
                 last n tokens of prompt and output (its repeat_last_n)
    dry_multiplier, dry_base, dry_allowed_length, dry_window   [rows]   llama.cpp's DRY (0: off;
                 `dry_penalties`), over the row's history
    bias_ids, bias_values  [rows, MAX_LOGIT_BIAS]  logit_bias entries (NO_TOKEN pads)
    logprobs     [rows] bool  whether the row's request asks for logprobs (`token_logprobs`)
    post_sampling [rows] bool  its logprobs are of the distribution it drew from, after every
                 filter and the temperature (llama-server's post_sampling_probs), not the raw one
    typical_p, top_n_sigma, xtc_probability, xtc_threshold, dynatemp_range, dynatemp_exponent
                 [rows] f32   llama.cpp's samplers (1, 0, 0, -, 0, -: off)
    temperature_last  [rows] bool  llama.cpp's order rather than vLLM's (below)
    mirostat, mirostat_tau, mirostat_eta  [rows]   llama.cpp's Mirostat 1 or 2 (0: off), whose
                 bound mu moves with every token (`mirostat`; device state in `TokenHistory`)
    adaptive_target, adaptive_decay  [rows] f32   llama.cpp's adaptive-p (a negative target:
                 off), whose average moves with every token too (`adaptive`)

Beside them, `choose` takes each row's token bitmask (`allowed`, [rows, ceil(vocab / 32)] int32,
llguidance's layout: bit j of word i allows token 32 i + j), which a grammar fills on the host
for structured output; a row of all ones (`ALL_ALLOWED`) constrains nothing.

The order is vLLM's: logit_bias, the penalties and DRY change the logits (greedy rows too), the
bitmask sends the tokens it forbids to -inf, then temperature, min_p, top-k and top-p shape the
distribution a sampled row draws from. A row of llama.cpp's order (`temperature_last`, what
llama-server's endpoints ask for) filters the logits as they are, with top-n-sigma, top-k,
typical, top-p, min_p and XTC in that order, and applies its temperature, dynamic or not, to
what they leave; at temperature 0 it takes the likeliest token left (`kept`). A Mirostat
row then keeps only the tokens its bound allows (`mirostat`); an adaptive-p row draws from
logits remade from the kept tokens' probabilities (`adaptive`). The penalties and those two read
the row's token history, device state the programs carry and update (`TokenHistory`): how often
each id was generated, which ids the prompt holds, the stateful samplers' state.

A row's randomness depends only on its own seed and step (e.g. its position), never on which
other requests share the batch, so a seeded request is reproducible alone or batched.
Each stage runs only if some row of the batch uses it (`model.control.when`): on a CPU an
all-greedy batch without penalties or biases is one argmax, as before any of them existed; on a
GPU every stage runs and its result is selected, so that no branch waits on the device. In the
programs the CPU kernels serve, top-k's and top-p's thresholds and the draw's noise are theirs
(`cpu_kernels.mass_threshold`, `_draw`; docs/cpu-kernels.md), with the same tokens.

The host side (`RequestSampling`, one request's validated settings; `SamplingRows`, the per-slot
NumPy rows; `SamplingParams`, the rows as the programs take them; the bitmask layout) is
`model.host_sampling`, which imports no JAX.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.extend.random import threefry2x32_p

from cadence.model import cpu_kernels
from cadence.model.control import when
from cadence.model.host_sampling import ALL_ALLOWED, NO_TOKEN, SAMPLER_STATE, SamplingParams


@struct.dataclass
class TokenHistory:
    """What the penalties read, per slot, on the device (donated through every program):

        counts  [slots, vocab] int32  how often each id was generated (the output so far), or
                                      for a windowed row (`penalty_window` n > 0) how often it
                                      occurs in the last n tokens of prompt and output
        prompt  [slots, vocab] bool   which ids the prompt holds (none for a windowed row: its
                                      prompt is in its counts)
        tokens  [slots, seq] int32    the sequence so far (NO_TOKEN past it), whose oldest
                                      token leaves a window as a new one comes
        length  [slots] int32         its length
        breaker [slots, vocab] bool   DRY's sequence breakers (`RequestSampling.dry_breakers`)
        match   [slots, seq] int32    for DRY, at each position k before the last: how many
                                      tokens the sequence up to k and the whole sequence end
                                      alike (the repetition that token k + 1 went on with)
        sampler [slots, SAMPLER_STATE] f32   a stateful sampler's state after the slot's last
                                      token: Mirostat's mu (`mirostat`), or adaptive-p's
                                      decayed sum of drawn probabilities and its weight
                                      (`adaptive`)

    A row is written whole when a penalized or stateful request takes its slot (`set_row`,
    from the tokens the host knows, and the sampler's state: its first, or what the host read
    back when the request left another slot) and then counted on: every token a penalized row
    samples adds one (and a windowed row drops the one that falls out of its window, as
    llama.cpp's ring does), and a stateful row's state moves on. Rows of other requests are
    neither read (their penalties are neutral) nor kept current."""

    counts: jax.Array
    prompt: jax.Array
    tokens: jax.Array
    length: jax.Array
    breaker: jax.Array
    match: jax.Array
    sampler: jax.Array

    @classmethod
    def create(cls, slots: int, vocab: int, seq_len: int, device=None) -> TokenHistory:
        return cls(counts=jnp.zeros((slots, vocab), jnp.int32, device=device),
                   prompt=jnp.zeros((slots, vocab), bool, device=device),
                   tokens=jnp.full((slots, seq_len), NO_TOKEN, jnp.int32, device=device),
                   length=jnp.zeros(slots, jnp.int32, device=device),
                   breaker=jnp.zeros((slots, vocab), bool, device=device),
                   match=jnp.zeros((slots, seq_len), jnp.int32, device=device),
                   sampler=jnp.zeros((slots, SAMPLER_STATE), jnp.float32, device=device))

    def count(self, slots: jax.Array, tokens: jax.Array, params: SamplingParams,
              sampler: jax.Array | None = None) -> TokenHistory:
        """Adds `tokens` [rows] to the rows `slots` [rows] (a slot past the last drops out)
        whose request is penalized; a windowed row's token `window` back leaves its counts.
        A stateful row's sampler state becomes its entry of `sampler` [rows, SAMPLER_STATE]
        (`choose`'s, after the token)."""
        penalized = params.penalized
        add = penalized.astype(jnp.int32)
        num_slots, seq = self.tokens.shape
        n = jnp.take(self.length, slots, mode="clip")
        window = params.penalty_window
        leaving = self.tokens[jnp.minimum(slots, num_slots - 1), jnp.clip(n - window, 0, seq - 1)]
        leaves = (penalized & (window > 0) & (n >= window)).astype(jnp.int32)
        counts = self.counts.at[slots, tokens].add(add, mode="drop")
        into = jnp.where(penalized, slots, num_slots)  # the others' rows stay as they are

        def extend(match):  # a DRY row's repetitions: those `tokens` goes on with grow by one
            rows = jnp.minimum(slots, num_slots - 1)
            before = jnp.pad(match[rows, :-1], ((0, 0), (1, 0)))  # [rows, seq]: each position's predecessor's
            at = jnp.arange(seq)
            grown = jnp.where((self.tokens[rows] == tokens[:, None]) & (at < n[:, None]), before + 1, 0)
            return match.at[jnp.where(params.dry_multiplier != 0, slots, num_slots)].set(grown, mode="drop")

        state = self.sampler if sampler is None else self.sampler.at[
            jnp.where(params.stateful, slots, num_slots)].set(sampler, mode="drop")
        return self.replace(counts=counts.at[slots, leaving].add(-leaves, mode="drop"),
                            tokens=self.tokens.at[into, n].set(tokens, mode="drop"),
                            length=self.length.at[into].add(1, mode="drop"),
                            match=when(jnp.any(params.dry_multiplier != 0), extend, _same, self.match),
                            sampler=state)

    def set_row(self, slot: jax.Array, tokens: jax.Array, prompt_len: jax.Array,
                window: jax.Array, breakers: jax.Array, match: jax.Array,
                sampler: jax.Array) -> TokenHistory:
        """Row `slot` from a sequence `tokens` [seq] (NO_TOKEN pads): the first `prompt_len` are
        the prompt, the rest output; `window` (0: none) its request's `penalty_window`;
        `breakers` [MAX_DRY_BREAKERS] (NO_TOKEN pads) its DRY breakers, and `match` [seq] each
        position's repetition (`host_sampling.dry_matches`; zeros for a request not on DRY);
        `sampler` [SAMPLER_STATE] its stateful sampler's state."""
        vocab = self.counts.shape[1]
        at = jnp.arange(tokens.shape[0])
        n = jnp.sum(tokens != NO_TOKEN, dtype=jnp.int32)
        in_prompt = at < prompt_len
        counted = jnp.where(window > 0, (at >= n - window) & (at < n), ~in_prompt)
        counts = jnp.zeros(vocab, jnp.int32).at[tokens].add(counted.astype(jnp.int32), mode="drop")
        shown = in_prompt & (window == 0)
        prompt = jnp.zeros(vocab, bool).at[jnp.where(shown, tokens, NO_TOKEN)].set(True, mode="drop")
        return self.replace(counts=self.counts.at[slot].set(counts),
                            prompt=self.prompt.at[slot].set(prompt),
                            tokens=self.tokens.at[slot].set(tokens), length=self.length.at[slot].set(n),
                            breaker=self.breaker.at[slot].set(
                                jnp.zeros(vocab, bool).at[breakers].set(True, mode="drop")),
                            match=self.match.at[slot].set(match),
                            sampler=self.sampler.at[slot].set(sampler))


def _same(x):
    return x


# Whether some row of the batch uses a stage: each stage's branch, and `choose`'s test for a
# batch no stage changes.
def _constrained(allowed: jax.Array) -> jax.Array:
    return jnp.any(allowed != ALL_ALLOWED)


def _biased(params: SamplingParams) -> jax.Array:
    return jnp.any(params.bias_ids != NO_TOKEN)


def _sampled(params: SamplingParams) -> jax.Array:
    return jnp.any(params.filtered)


def apply_bitmask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """`logits` [rows, vocab] with every token a row's bitmask `allowed` [rows, words] forbids
    at -inf; runs only if some row is constrained (unconstrained rows come out bit-identical)."""
    vocab = logits.shape[-1]

    def mask(logits):
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (allowed[:, :, None] >> shifts) & 1  # [rows, words, 32]: arithmetic shift, then the bit
        keep = bits.reshape(allowed.shape[0], -1)[:, :vocab] == 1
        return jnp.where(keep, logits, -jnp.inf)

    return when(_constrained(allowed), mask, _same, logits)


def adjust_logits(logits: jax.Array, params: SamplingParams, history: TokenHistory,
                  slots: jax.Array) -> jax.Array:
    """logit_bias, then the penalties over each row's history (row i's is `slots[i]`'s). Each
    runs only if some row uses it; unused rows come out bit-identical."""
    rows = jnp.arange(logits.shape[0])[:, None]

    def bias(logits):
        return logits.at[rows, params.bias_ids].add(params.bias_values, mode="drop")

    def penalize(logits):
        counts = jnp.take(history.counts, slots, axis=0, mode="clip")
        generated = counts > 0
        seen = generated | jnp.take(history.prompt, slots, axis=0, mode="clip")
        rep = params.repetition_penalty[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - params.frequency_penalty[:, None] * counts.astype(logits.dtype)
        return logits - params.presence_penalty[:, None] * generated.astype(logits.dtype)

    logits = when(_biased(params), bias, _same, logits)
    logits = when(jnp.any(params.penalized), penalize, _same, logits)
    return when(jnp.any(params.dry_multiplier != 0), lambda x: x - dry_penalties(history, slots, params),
                _same, logits)


# exp(88.72...) is float32's largest: DRY's exponent stops where its base would reach it.
_FLOAT_MAX_LOG = 88.7228391


def dry_penalties(history: TokenHistory, slots: jax.Array, params: SamplingParams) -> jax.Array:
    """[rows, vocab] what llama.cpp's DRY takes off each token's logit, row i over slot
    `slots[i]`'s history: a token that would go on with a repetition of the end of the last
    `dry_window` tokens (of prompt and output) of at least `dry_allowed_length` tokens loses
    dry_multiplier x dry_base ** (its longest such repetition's length - dry_allowed_length);
    a repetition reaches back no further than the last breaker, and breakers lose nothing."""
    rows = jnp.arange(slots.shape[0])
    tokens = jnp.take(history.tokens, slots, axis=0, mode="clip")
    match = jnp.take(history.match, slots, axis=0, mode="clip")
    breaker = jnp.take(history.breaker, slots, axis=0, mode="clip")
    n = jnp.take(history.length, slots, mode="clip")[:, None]
    vocab, at = breaker.shape[1], jnp.arange(tokens.shape[1])[None]
    window = jnp.minimum(n, params.dry_window[:, None])
    start = n - window
    broken = jnp.take_along_axis(breaker, jnp.clip(tokens, 0, vocab - 1), axis=1) & (at >= start) & (at < n)
    last_break = jnp.max(jnp.where(broken, at, -1), axis=1, keepdims=True)
    limit = jnp.where(last_break >= 0, n - 1 - last_break, window)  # tokens since the last breaker
    allowed = params.dry_allowed_length[:, None]
    length = jnp.minimum(jnp.minimum(match, at - start + 1), limit)
    on = (params.dry_multiplier != 0)[:, None] & (window > allowed) & (limit >= allowed)
    counted = on & (at >= start) & (at < n - 1) & (length >= allowed)
    following = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)), constant_values=NO_TOKEN)
    longest = jnp.full((slots.shape[0], vocab), -1, jnp.int32).at[
        rows[:, None], jnp.where(counted, following, NO_TOKEN)].max(length, mode="drop")
    base = params.dry_base[:, None]
    most = jnp.where(base > 1.000001, jnp.floor(_FLOAT_MAX_LOG / jnp.log(base)), 0)
    exponent = (longest - allowed).astype(jnp.float32)
    exponent = jnp.where((most > 0) & (exponent > most), most, exponent)
    penalty = params.dry_multiplier[:, None] * jnp.power(base, exponent)
    return jnp.where((longest >= 0) & ~breaker, penalty, 0.0)


@struct.dataclass
class Logprobs:
    """The model's raw distribution at each sampled token (log_softmax of the logits, before
    bias, penalties, temperature and filters, as OpenAI and vLLM report it):

        token  [rows] f32      the sampled token's logprob
        ids    [rows, k] i32   the k likeliest ids, likeliest first
        values [rows, k] f32   their logprobs
        rank   [rows] i32      the token's rank: how many ids are at least as likely (itself
                               included, as vLLM counts); only where asked (`ranked`)"""

    token: jax.Array
    ids: jax.Array
    values: jax.Array
    rank: jax.Array | None = None


def logprobs_of(logits: jax.Array, tokens: jax.Array, k: int, wanted: jax.Array,
                ranked: bool = False) -> Logprobs:
    """`Logprobs` of `tokens` [rows] under `logits` [rows, vocab], computed only if some row is
    `wanted` (zeros otherwise); with `ranked`, each token's rank too."""
    rows = logits.shape[0]

    def compute(logits):
        lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        token = jnp.take_along_axis(lsm, tokens[:, None], axis=-1)[:, 0]
        values, ids = jax.lax.top_k(lsm, k) if k else (jnp.zeros((rows, 0)), jnp.zeros((rows, 0), jnp.int32))
        rank = jnp.sum(lsm >= token[:, None], axis=-1, dtype=jnp.int32) if ranked else None
        return Logprobs(token=token, ids=ids.astype(jnp.int32), values=values.astype(jnp.float32),
                        rank=rank)

    def skip(logits):
        return Logprobs(token=jnp.zeros(rows, jnp.float32), ids=jnp.zeros((rows, k), jnp.int32),
                        values=jnp.zeros((rows, k), jnp.float32),
                        rank=jnp.zeros(rows, jnp.int32) if ranked else None)

    return when(jnp.any(wanted), compute, skip, logits)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (negative floats' bits flipped whole, positive
    ones' sign bit set), so a bisection over keys visits every float32 between two values."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target: keeping `keys >= t`
    keeps the fewest values from the top whose weight reaches the target (with ties at the
    boundary, all of them). 32 halvings of the key range, each one masked sum over the row:
    no sort, which on a CPU costs several times a decode step over a large vocabulary."""
    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + (gap & 1)  # the upper middle, without overflowing uint32
        enough = jnp.sum(jnp.where(keys >= mid[:, None], weights, 0), axis=-1) >= target
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    rows = keys.shape[0]
    lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.zeros(rows, jnp.uint32),
                                             jnp.full(rows, 2**32 - 1, jnp.uint32)))
    return lo


def _cut(keys: jax.Array, target: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """`_threshold` of `keys` with `weights` (None: every weight 1, target k: the k-th largest
    key): in the CPU kernels' programs theirs, one selection (`kth_largest`,
    `mass_threshold`), elsewhere the bisection."""
    if cpu_kernels.serving():
        if weights is None:
            return cpu_kernels.kth_largest(keys, target)
        return cpu_kernels.mass_threshold(keys, weights, target)
    if weights is None:
        weights, target = jnp.ones(keys.shape, jnp.float32), target.astype(jnp.float32)
    return _threshold(keys, weights, target)


def kept(logits: jax.Array, params: SamplingParams,
         rngs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the logits a row draws from, which tokens it may draw, whether it draws at all: its
    final temperature is above 0), each filter a threshold found
    by bisection (`_threshold`) and run only if some row uses it. In vLLM's order the logits are
    scaled by the temperature first, then min_p, top-k and top-p filter them; in llama.cpp's
    (`temperature_last`) top-n-sigma, top-k, typical, top-p, min_p and XTC filter the unscaled
    logits, and the temperature (dynamic, with dynatemp_range) scales what they leave.
    top-k keeps the k likeliest (and any tied with the k-th); top-p keeps, from the likeliest
    down, tokens while the mass before them is below top_p of what the filters before it kept
    (the first always stays); `rngs` [rows] are the rows' keys (XTC's coin)."""
    vocab = logits.shape[-1]
    last = params.temperature_last
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / jnp.where(last, 1.0, temperature)[:, None]
    keys = _order_keys(scaled)
    # min_p: a token stays if its probability is at least min_p x the likeliest one's, i.e. its
    # scaled logit is within log(min_p) of the largest (min_p 0: log 0 = -inf keeps every one).
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    min_p = scaled >= peak + jnp.log(params.min_p)[:, None]
    top_k = jnp.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, vocab)

    def probs(keep):  # each kept token's weight, exp(logit - peak): its probability x a row's sum
        return jnp.where(keep, jnp.exp(scaled - peak), 0)

    def sigma(keep):  # within top_n_sigma standard deviations of the largest finite logit
        finite = jnp.isfinite(scaled)
        count = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
        mean = jnp.sum(jnp.where(finite, scaled, 0), axis=-1, keepdims=True) / count
        std = jnp.sqrt(jnp.sum(jnp.where(finite, jnp.square(scaled - mean), 0), axis=-1, keepdims=True) / count)
        return keep & ((scaled >= peak - params.top_n_sigma[:, None] * std) | (params.top_n_sigma <= 0)[:, None])

    def top(keep):
        return keep & (keys >= _cut(keys, top_k)[:, None])

    def typical(keep):  # the tokens whose surprise is nearest the entropy, typical_p of the mass
        weights = probs(keep)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        logp = scaled - peak - jnp.log(total)
        entropy = -jnp.sum(jnp.where(weights > 0, weights / total * logp, 0), axis=-1, keepdims=True)
        near = _order_keys(-jnp.abs(logp + entropy))
        cut = _cut(jnp.where(keep, near, 0), params.typical_p * total[:, 0], weights)
        return keep & ((near >= cut[:, None]) | (params.typical_p >= 1)[:, None])

    def nucleus(keep):
        weights = probs(keep)
        cut = _cut(jnp.where(keep, keys, 0), params.top_p * jnp.sum(weights, axis=-1), weights)
        return keep & ((keys >= cut[:, None]) | (params.top_p >= 1)[:, None])

    def xtc(keep):  # with xtc_probability, out go the tokens >= the threshold but the least likely
        weights = probs(keep)
        likely = (weights > 0) & (weights >= params.xtc_threshold[:, None] * jnp.sum(weights, axis=-1, keepdims=True))
        least = jnp.min(jnp.where(likely, weights, jnp.inf), axis=-1, keepdims=True)
        coin = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, XTC_STREAM)))(rngs)
        on = ((coin < params.xtc_probability) & (params.xtc_threshold <= 0.5)
              & (jnp.sum(likely, axis=-1) >= 2))
        return keep & ~(likely & (weights > least) & on[:, None])

    keep = jnp.where(last[:, None], True, min_p)
    keep = when(jnp.any(params.top_n_sigma > 0), sigma, _same, keep)
    keep = when(jnp.any(top_k < vocab), top, _same, keep)
    keep = when(jnp.any(last & (params.typical_p < 1)), typical, _same, keep)
    keep = when(jnp.any(params.top_p < 1), nucleus, _same, keep)
    keep = keep & min_p
    keep = when(jnp.any(last & (params.xtc_probability > 0)), xtc, _same, keep)

    def dynamic(scaled):
        """llama.cpp's temp_ext: the entropy of what is kept, over the most it could be (all of
        it equally likely), maps onto [temperature - range, temperature + range] (from 0)."""
        weights = probs(keep)
        total = jnp.sum(weights, axis=-1)
        logp = scaled - peak - jnp.log(total)[:, None]
        entropy = -jnp.sum(jnp.where(weights > 0, weights / total[:, None] * logp, 0), axis=-1)
        most = jnp.log(jnp.maximum(jnp.sum(keep, axis=-1), 2))  # (one token left: any temperature)
        low = jnp.maximum(params.temperature - params.dynatemp_range, 0)
        high = params.temperature + params.dynatemp_range
        spread = jnp.power(entropy / most, params.dynatemp_exponent)
        return jnp.where(last & (params.dynatemp_range > 0), low + (high - low) * spread, params.temperature)

    final = when(jnp.any(last & (params.dynatemp_range > 0)), dynamic,
                 lambda _: params.temperature, scaled)
    # At a temperature of 0 a row takes the likeliest token it kept, as llama.cpp's temp
    # sampler does (in vLLM's order: the likeliest of all, which every filter keeps).
    hot = final > 0
    return jnp.where(last[:, None], scaled / jnp.where(hot, final, 1.0)[:, None], scaled), keep, hot


XTC_STREAM = 0x58544321  # XTC's coin: the row's key folded with this, apart from the draw's noise

# Mirostat 1 estimates how fast a row's probabilities fall (their Zipf exponent) from its 100
# likeliest tokens, as llama.cpp's does.
MIROSTAT_M = 100


def mirostat(scaled: jax.Array, keep: jax.Array, params: SamplingParams, mu: jax.Array) -> jax.Array:
    """What llama.cpp's Mirostat keeps, per Mirostat row, of what `kept` left (`keep`) of its
    scaled logits (other rows' as they are), under its bound `mu` [rows] (bits):
    Mirostat 2 the tokens whose surprise, -log2 p, is at most mu; Mirostat 1 the k likeliest,
    k = (e 2^mu / (1 - vocab^-e))^(1/s), from s, the exponent of a Zipf law fitted to the
    MIROSTAT_M likeliest (e = s - 1). Each keeps the likeliest token at least (a k past the
    vocabulary keeps every token; where the fit fails, one token is left)."""
    vocab = scaled.shape[-1]
    masked = jnp.where(keep, scaled, -jnp.inf)
    keys = _order_keys(masked)
    peak = jnp.max(masked, axis=-1)
    log_total = jnp.log(jnp.sum(jnp.exp(masked - peak[:, None]), axis=-1))
    # Mirostat 2: -log2 p <= mu, i.e. a logit at least peak + log(total) - mu ln 2, with the peak.
    bound = jnp.minimum(peak + log_total - mu * math.log(2), peak)

    def zipf(keys):  # Mirostat 1: s from the ratios of neighbouring probabilities among the m likeliest
        m = min(MIROSTAT_M, vocab)
        top = _largest(masked, keys, m)
        i = jnp.arange(m - 1, dtype=jnp.float32)
        t = jnp.log((i + 2) / (i + 1))
        pairs = jnp.isfinite(top[:, 1:])  # (both kept: the likelier one is too)
        s_hat = (jnp.sum(jnp.where(pairs, t * (top[:, :-1] - top[:, 1:]), 0), axis=-1)
                 / jnp.sum(jnp.where(pairs, t * t, 0), axis=-1))
        e = s_hat - 1
        k = jnp.power(e * jnp.exp2(mu) / (1 - jnp.power(jnp.float32(vocab), -e)), 1 / s_hat)
        return _cut(keys, jnp.where(jnp.isnan(k), 1, jnp.clip(k, 1, vocab)).astype(jnp.int32))

    first = params.mirostat == 1
    cut = jnp.where(first, when(jnp.any(first), zipf, lambda _: jnp.zeros(first.shape, jnp.uint32), keys),
                    _order_keys(bound))
    return keep & ((keys >= cut[:, None]) | (params.mirostat == 0)[:, None])


def _largest(values: jax.Array, keys: jax.Array, m: int) -> jax.Array:
    """[rows, m]: each row's m largest `values` (their order `keys`, `_order_keys`), largest
    first: those above the m-th largest key (`_cut`) and then those at it, gathered in that
    order and sorted. No sort of the whole row, which is what XLA's top_k does on a CPU (80 ms
    a step for 8 x 49,152 with m = 100)."""
    rows = values.shape[0]
    cut = _cut(keys, jnp.full(rows, m, jnp.int32))[:, None]
    above, at = keys > cut, keys == cut
    first = jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    slot = jnp.where(above, jnp.cumsum(above, axis=-1, dtype=jnp.int32) - 1,
                     jnp.where(at, first + jnp.cumsum(at, axis=-1, dtype=jnp.int32) - 1, m))
    gathered = jnp.full((rows, m), -jnp.inf, values.dtype).at[
        jnp.arange(rows)[:, None], slot].set(values, mode="drop")
    return -jnp.sort(-gathered, axis=-1)


def sampler_moved(scaled: jax.Array, keep: jax.Array, hot: jax.Array, tokens: jax.Array,
                  params: SamplingParams, state: jax.Array) -> jax.Array:
    """Each stateful row's state after drawing `tokens`, from p, the token's probability among
    what `kept` and Mirostat kept (`keep`) of `scaled` (a row at a temperature of 0, not
    `hot`, took its token at probability 1): Mirostat's mu less eta x (its surprise, -log2 p,
    less tau); adaptive-p's sum decayed with p added, and its weight decayed with 1 added.
    Other rows' state as it is."""
    masked = jnp.where(keep, scaled, -jnp.inf)
    log_p = jnp.take_along_axis(masked, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(masked, axis=-1)
    log_p = jnp.where(hot, log_p, 0.0)
    mu = state[:, 0] - params.mirostat_eta * (-log_p / math.log(2) - params.mirostat_tau)
    decay = params.adaptive_decay
    averaged = jnp.stack([jnp.exp(log_p) + decay * state[:, 0], 1 + decay * state[:, 1]], axis=-1)
    return jnp.where((params.mirostat != 0)[:, None], jnp.stack([mu, state[:, 1]], axis=-1),
                     jnp.where((params.adaptive_target >= 0)[:, None], averaged, state))


# llama.cpp's adaptive-p transform: a token's logit from its probability's distance to the
# target, quadratic near it, linear in the tails.
ADAPTIVE_WIDTH, ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS = 0.3, 5.0, 10.0


def adaptive(scaled: jax.Array, keep: jax.Array, params: SamplingParams, state: jax.Array) -> jax.Array:
    """The logits an adaptive-p row draws from (other rows' `scaled` as they are), llama.cpp's:
    each token of `keep` with a finite logit gets PEAK - SHARPNESS d^2 / (1 + d), where d is
    the distance of its probability p (under what `keep` holds of `scaled`) to the adapted
    target over WIDTH. The adapted target, within [0, 1], is 2 target less the average of the
    drawn tokens' probabilities so far (`state`: their decayed sum and its weight), so that a
    row drawing likelier tokens than its target aims lower next, and the other way round."""
    masked = jnp.where(keep, scaled, -jnp.inf)
    p = jax.nn.softmax(masked, axis=-1)
    target = jnp.clip(params.adaptive_target, 0.0, 1.0)
    weight = state[:, 1]
    adapted = jnp.clip(jnp.where(weight == 0, target, 2 * target - state[:, 0] / jnp.where(weight == 0, 1, weight)),
                       0.0, 1.0)
    d = jnp.abs(p - adapted[:, None]) / ADAPTIVE_WIDTH
    remade = ADAPTIVE_PEAK - ADAPTIVE_SHARPNESS * d * d / (1 + d)
    on = (params.adaptive_target >= 0)[:, None] & keep & (masked > -jnp.inf)
    return jnp.where(on, remade, scaled)


def argmax(logits: jax.Array) -> jax.Array:
    """Each row's likeliest token, int32 (`cpu_kernels.argmax`: where the CPU kernels serve
    the program, theirs)."""
    return cpu_kernels.argmax(logits)


# The most tokens that may win a row's draw for the CPU kernels' programs to score them alone
# (`_draw`); almost always one does. Else the draw scores DRAW_CHUNK tokens at a time.
DRAW_WIDTH = 16
DRAW_CHUNK = 8192


def _default_threefry() -> bool:
    """Whether keys are JAX's default threefry2x32 with its partitionable bits, as `gumbel_at`
    and the CPU kernels' noise make them."""
    return jax.config.jax_default_prng_impl == "threefry2x32" and jax.config.jax_threefry_partitionable


def gumbel_at(key: jax.Array, indices: jax.Array) -> jax.Array:
    """`jax.random.gumbel(key, (n,))[indices]` for any n > max(indices), to the bit, computing
    only those entries: under JAX's partitionable threefry (its default), element j's bits are
    the hash of the counter j alone, and uniform and gumbel map each element's bits alone.
    `indices` int32 [m] >= 0."""
    k1, k2 = jax.random.key_data(key)
    counts = indices.astype(jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(jnp.broadcast_to(k1, counts.shape), jnp.broadcast_to(k2, counts.shape),
                                       jnp.zeros_like(counts), counts)
    # jax.random.uniform(minval=tiny, maxval=1)'s float32 from 32 bits, then gumbel's -log(-log u).
    one = jnp.asarray(0x3F800000, jnp.uint32)
    floats = jax.lax.bitcast_convert_type(((bits1 ^ bits2) >> 9) | one, jnp.float32) - 1.0
    tiny = jnp.asarray(jnp.finfo(jnp.float32).tiny, jnp.float32)
    uniform = jax.lax.max(tiny, floats * (jnp.float32(1) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def _draw(scaled: jax.Array, keep: jax.Array, rngs: jax.Array, sampled: jax.Array) -> jax.Array:
    """jax.random.categorical's token per row over `scaled` [rows, vocab] where `keep`: the
    Gumbel-max trick, with `argmax` taking the max. XLA makes the noise for the whole row (8.6
    ms a step for 8 x 151,936 on 2 cores). In the CPU kernels' programs a kernel makes it as it
    compares (`cpu_kernels.gumbel_candidates`) and names the few tokens that may win; where
    every `sampled` row has at most DRAW_WIDTH, XLA's own noise at those (`gumbel_at`), in
    ascending order so that ties go to the first index, picks the same token. Otherwise (a row
    of NaN or only -inf, or many tokens tied for the lead) XLA's noise picks over the whole
    row, DRAW_CHUNK tokens at a time: a branch holding the whole row's noise cost the step 6-7
    ms even where it was not taken."""
    masked = jnp.where(keep, scaled, -jnp.inf)
    if not (cpu_kernels.serving() and _default_threefry()):
        noise = jax.vmap(lambda key: jax.random.gumbel(key, masked.shape[-1:], masked.dtype))(rngs)
        return argmax(noise + masked)
    candidates, counts = cpu_kernels.gumbel_candidates(jax.random.key_data(rngs), masked, DRAW_WIDTH)

    def among_candidates(masked):
        noise = jax.vmap(gumbel_at)(rngs, candidates)
        listed = jnp.arange(DRAW_WIDTH) < counts[:, None]
        values = jnp.where(listed, jnp.take_along_axis(masked, candidates, axis=-1), -jnp.inf)
        return jnp.take_along_axis(candidates, argmax(noise + values)[:, None], axis=-1)[:, 0]

    def in_chunks(masked):
        rows, vocab = masked.shape
        padded = jnp.pad(masked, ((0, 0), (0, -vocab % DRAW_CHUNK)), constant_values=-jnp.inf)

        def chunk(i, best):  # (score, index) of the first NaN, else of the first maximum, so far
            score, index = best
            at = i * DRAW_CHUNK + jnp.arange(DRAW_CHUNK, dtype=jnp.int32)
            scores = jax.vmap(gumbel_at, in_axes=(0, None))(rngs, at) + jax.lax.dynamic_slice_in_dim(
                padded, i * DRAW_CHUNK, DRAW_CHUNK, axis=1)
            first = argmax(scores)
            top = jnp.take_along_axis(scores, first[:, None], axis=-1)[:, 0]
            later = (top > score) | (jnp.isnan(top) & ~jnp.isnan(score))
            return jnp.where(later, top, score), jnp.where(later, i * DRAW_CHUNK + first, index)

        start = (jnp.full(rows, -jnp.inf), jnp.zeros(rows, jnp.int32))
        return jax.lax.fori_loop(0, padded.shape[1] // DRAW_CHUNK, chunk, start)[1]

    return when(jnp.all((counts <= DRAW_WIDTH) | ~sampled), among_candidates, in_chunks, masked)


def _keys(params: SamplingParams, step: jax.Array) -> jax.Array:
    """Each row's key at `step`: its seed's, folded with the step."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(params.seed, step)


def _alone(tokens: jax.Array, k: int) -> Logprobs:
    """`Logprobs` of a distribution holding each row's token alone (a greedy row's draw, as
    llama.cpp's temperature sampler at 0 leaves it): the token at probability 1, then -inf."""
    first = jnp.arange(k) == 0
    ids = jnp.where(first, tokens[:, None], 0).astype(jnp.int32)
    values = jnp.broadcast_to(jnp.where(first, 0.0, -jnp.inf), ids.shape).astype(jnp.float32)
    return Logprobs(token=jnp.zeros(tokens.shape, jnp.float32), ids=ids, values=values)


def _sample_filtered(logits: jax.Array, params: SamplingParams, step: jax.Array, k: int,
                     sampler: jax.Array) -> tuple[jax.Array, Logprobs, jax.Array]:
    """One categorical draw per row over what `kept` leaves of its scaled logits (and a
    Mirostat row's bound, `mirostat`, of that; an adaptive-p row's logits remade, `adaptive`);
    a row at a temperature of 0 takes the likeliest token kept. With it, the `Logprobs` (top `k`) of what each row drew from, for the
    rows that ask (`post_sampling` with `logprobs`), and each row's sampler state after its
    token (`sampler` [rows, SAMPLER_STATE], the state before)."""
    rngs = _keys(params, step)
    scaled, keep, hot = kept(logits, params, rngs)
    on_mirostat, on_adaptive = jnp.any(params.mirostat != 0), jnp.any(params.adaptive_target >= 0)
    keep = when(on_mirostat, lambda keep: mirostat(scaled, keep, params, sampler[:, 0]), _same, keep)
    final = when(on_adaptive, lambda s: adaptive(s, keep, params, sampler), _same, scaled)
    likeliest = argmax(jnp.where(keep | ~params.temperature_last[:, None], logits, -jnp.inf))
    tokens = jnp.where(hot, _draw(final, keep, rngs, hot), likeliest).astype(jnp.int32)
    sampler = when(on_mirostat | on_adaptive,
                   lambda state: sampler_moved(scaled, keep, hot, tokens, params, state), _same, sampler)

    def drawn(final):  # (built in the branch: a [rows, vocab] pass only where some row asks)
        alone = jnp.where(jnp.arange(final.shape[-1]) == tokens[:, None], 0.0, -jnp.inf)
        return jnp.where(hot[:, None], jnp.where(keep, final, -jnp.inf), alone)

    post = params.post_sampling & params.logprobs
    return tokens, when(jnp.any(post), lambda s: logprobs_of(drawn(s), tokens, k, post),
                        lambda _: _alone(tokens, k), final), sampler


def sample(logits: jax.Array, params: SamplingParams, step: jax.Array) -> jax.Array:
    """Picks one token per row from logits already adjusted (`adjust_logits`). `step` [rows]
    makes each draw distinct (use the position). A stateful row (Mirostat, adaptive-p) reads
    its state from the slot's history: `choose`; here it draws from a state of zeros."""
    state = jnp.zeros((logits.shape[0], SAMPLER_STATE), jnp.float32)
    return when(_sampled(params), lambda logits: _sample_filtered(logits, params, step, 0, state)[0],
                argmax, logits)


def choose(logits: jax.Array, params: SamplingParams, history: TokenHistory, slots: jax.Array,
           step: jax.Array, k: int,
           allowed: jax.Array | None = None) -> tuple[jax.Array, Logprobs, jax.Array]:
    """Every stage for the rows of `logits` [rows, vocab], row i being slot `slots[i]`: the
    adjusted logits' token per row, among those its bitmask `allowed` [rows, words] allows
    (None: every token), and the raw logits' `Logprobs` (top `k`) of it; a `post_sampling`
    row's (llama-server's post_sampling_probs) are of the distribution it drew from: what
    every filter left of its logits as the temperature scaled them. Third, each row's sampler
    state after its token ([rows, SAMPLER_STATE], for `TokenHistory.count`)."""
    sampler = jnp.take(history.sampler, slots, axis=0, mode="clip")

    def greedy(logits):
        tokens = argmax(logits)
        return tokens, _alone(tokens, k), sampler

    def adjusted(logits):
        adjusted = adjust_logits(logits, params, history, slots)
        if allowed is not None:
            adjusted = apply_bitmask(adjusted, allowed)
        return when(_sampled(params), lambda a: _sample_filtered(a, params, step, k, sampler),
                    greedy, adjusted)

    # A batch that no stage changes (every row greedy, no bias, penalty or bitmask) takes the
    # raw logits' argmax in a branch that gives back tokens alone: a stage's branch that
    # passes the logits through unchanged still copies them (the raw logits stay live for
    # the logprobs), 2 ms a step for 8 x 151,936 of them. (The post-sampling `Logprobs` each
    # branch gives back are [rows, k]: on a GPU, where both sides run, the draw's own cost a
    # softmax and a top-k over what it kept; on a CPU, only where a row asks.)
    changed = _biased(params) | jnp.any(params.penalized) | _sampled(params)
    if allowed is not None:
        changed = changed | _constrained(allowed)
    tokens, drawn, sampler = when(changed, adjusted, greedy, logits)
    raw = logprobs_of(logits, tokens, k, params.logprobs)
    post = params.post_sampling

    def pick(drawn_value, raw_value):
        return jnp.where(post.reshape(post.shape + (1,) * (raw_value.ndim - 1)), drawn_value, raw_value)

    return tokens, Logprobs(token=pick(drawn.token, raw.token), ids=pick(drawn.ids, raw.ids),
                            values=pick(drawn.values, raw.values), rank=raw.rank), sampler
