"""The reference generator: greedy decoding in the simplest correct form.

One sequence, one KV page that holds prompt + output (so, a contiguous slot), the whole prompt
in one forward, then one token at a time with the plain einsum attention ("reference") over
that page (prompt and page padded to a power of two, at least 64, so that nearby lengths share
programs). No batching, no buckets, no chunking, no donation, no paging to speak of. It is
the oracle the engine's fast paths (any attention, any page layout) are tested against, so it
stays boring on purpose.

With a `RequestSampling`, greedy picks from the logits after its logit_bias and penalties,
applied here in NumPy one row at a time (`adjusted_logits`), written apart from the device's
vectorized version (`model.sampling.adjust_logits`) so that each checks the other. With
`return_logprobs`, it also gives each output token's log-softmax values over the raw logits.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model.config import ModelConfig
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model.host_sampling import RequestSampling


@partial(jax.jit, static_argnames=("config",))
def _step(params, tokens, positions, last, cache, *, config):
    """The logits after position `last` of `tokens` [1, n] (at `positions`), their KV written."""
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    one_page = jnp.zeros((1, 1), jnp.int32)
    logits, cache = forward(
        params, tokens, positions, lengths, cache, one_page, config=config, attention="reference"
    )
    return logits[:, last], cache


def _padded(n: int) -> int:
    """A length padded to a power of two (at least 64), so that sequences of nearby lengths
    share the generator's programs: one per padded prompt and page length, not per length."""
    return max(64, 1 << (n - 1).bit_length())


def adjusted_logits(logits: np.ndarray, sampling: RequestSampling, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> np.ndarray:
    """One row's logits after `sampling`'s logit_bias, repetition penalty (HF's: over every id
    of prompt and output, a positive logit divided by it, a negative one multiplied), then
    frequency and presence penalties (OpenAI's: minus frequency x the id's count in the output,
    minus presence if it occurs there at all). With a `penalty_window` of n, all three read the
    last n tokens of prompt and output instead (llama.cpp's penalties)."""
    out = np.array(logits, np.float32)
    for token, bias in sampling.logit_bias:
        out[token] += np.float32(bias)
    if sampling.penalty_window:
        recent = [*prompt_ids, *output_ids][-sampling.penalty_window:]
        seen, counts = set(recent), collections.Counter(recent)
    else:
        seen, counts = set(prompt_ids) | set(output_ids), collections.Counter(output_ids)
    rep = np.float32(sampling.repetition_penalty)
    for token in seen:
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token, n in counts.items():
        out[token] -= np.float32(sampling.frequency_penalty) * np.float32(n)
        out[token] -= np.float32(sampling.presence_penalty)
    for token, penalty in dry_penalties(sampling, [*prompt_ids, *output_ids]).items():
        out[token] -= np.float32(penalty)
    return out


def dry_penalties(sampling: RequestSampling, sequence: Sequence[int]) -> dict[int, float]:
    """{token: what llama.cpp's DRY takes off its logit} after `sequence` (prompt and output),
    step by step as llama.cpp's sampler does it: over the last dry_window tokens, the tokens
    since the last breaker bound every repetition; each earlier position whose tokens end as
    the sequence ends, for at least dry_allowed_length of them, names the token after it, which
    would go on with that repetition; a token's longest one sets its penalty (breakers none)."""
    if not sampling.dry_multiplier:
        return {}
    window = list(sequence)[-sampling.dry_window:] if sampling.dry_window else []
    w, allowed, breakers = len(window), sampling.dry_allowed_length, set(sampling.dry_breakers)
    if w <= allowed:
        return {}
    since = next((i for i, t in enumerate(reversed(window)) if t in breakers), w)
    if since < allowed:
        return {}
    longest: dict[int, int] = {}
    for end in range(w - 1):  # a repetition ending at `end`, and the token after it
        n = 0
        while n <= end and window[end - n] == window[w - 1 - n]:
            n += 1
        n = min(n, since)
        if n >= allowed:
            longest[window[end + 1]] = max(longest.get(window[end + 1], -1), n)
    base = sampling.dry_base
    most = int(88.7228391 / np.log(base)) if base > 1.000001 else 0
    return {t: sampling.dry_multiplier * base ** (min(n - allowed, most) if most else n - allowed)
            for t, n in longest.items() if t not in breakers}


def greedy_generate(
    params,
    config: ModelConfig,
    prompt_ids: Sequence[int],
    max_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    *,
    return_logits: bool = False,
    sampling: RequestSampling | None = None,
    kv_dtype: str = "float32",
) -> list[int] | tuple[list[int], list[np.ndarray]]:
    """Greedy continuation of `prompt_ids`: at most `max_tokens` ids, stopping after an EOS id,
    each the argmax of the logits after `sampling`'s bias and penalties (its temperature and
    filters are not used: this is greedy).

    With `return_logits`, also returns the raw float32 logits of each output token's step.
    `kv_dtype`: the cache's (keys and values rounded to it as written, widened as read).
    """
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    total = len(prompt_ids) + max_tokens
    if total > config.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model context of {config.max_context} tokens"
        )
    out: list[int] = []
    all_logits: list[np.ndarray] = []
    if max_tokens == 0:
        return (out, all_logits) if return_logits else out
    # The prompt and the page padded (`_padded`): a padding token's KV, at a position past the
    # prompt, is never attended to (keys after a query's own position are masked) and is
    # overwritten by the output token at that position before any query can see it.
    n, padded = len(prompt_ids), _padded(len(prompt_ids))
    cache = PagedKVCache.create(config, num_pages=1, page_size=_padded(total),  # (total > n)
                                dtype=jnp.dtype(kv_dtype))
    tokens = jnp.asarray([list(prompt_ids) + [0] * (padded - n)], jnp.int32)
    positions = jnp.arange(padded, dtype=jnp.int32)[None]
    logits, cache = _step(params, tokens, positions, np.int32(n - 1), cache, config=config)
    while True:
        row = np.asarray(logits[0])
        if sampling is not None:
            row = adjusted_logits(row, sampling, prompt_ids, out)
        token = int(np.argmax(row))
        out.append(token)
        all_logits.append(np.asarray(logits[0]))
        if token in eos_ids or len(out) == max_tokens:
            break
        position = len(prompt_ids) + len(out) - 1
        logits, cache = _step(
            params,
            jnp.asarray([[token]], jnp.int32),
            jnp.asarray([[position]], jnp.int32),
            np.int32(0),
            cache,
            config=config,
        )
    return (out, all_logits) if return_logits else out


@partial(jax.jit, static_argnames=("config", "hidden"))
def _every_position(params, tokens, cache, *, config, hidden=False):
    n = tokens.shape[1]
    out, _ = forward(params, tokens, jnp.arange(n, dtype=jnp.int32)[None],
                     jnp.full((1,), n, jnp.int32), cache, jnp.zeros((1, 1), jnp.int32),
                     config=config, attention="reference", logit_index=None, hidden=hidden)
    return out[0]


def sequence_logits(params, config: ModelConfig, token_ids: Sequence[int],
                    hidden: bool = False) -> np.ndarray:
    """[len(token_ids), vocab] float32: the logits after each position, from one forward pass
    over the whole sequence (row i scores token i + 1); with `hidden`, [len, D]: each
    position's final hidden state (what an embedding pools). Jitted, as the generator's steps
    are: one program per length, where running it op by op compiles each operation for each
    new length (~15x the time on the tiny model)."""
    cache = PagedKVCache.create(config, num_pages=1, page_size=len(token_ids))
    out = _every_position(params, jnp.asarray([list(token_ids)], jnp.int32), cache, config=config,
                          hidden=hidden)
    return np.asarray(out, np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64, over the last axis: the reference's logprobs."""
    x = np.asarray(logits, np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
