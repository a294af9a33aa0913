"""The reference generator: greedy decoding in the simplest correct form.

One sequence, one KV page sized exactly for prompt + output (so, a contiguous slot), the whole
prompt in one forward, then one token at a time with the plain einsum attention ("reference")
over that page. No batching, no buckets, no chunking, no donation, no paging to speak of. It is
the oracle the engine's fast paths (any attention, any page layout) are tested against, so it
stays boring on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model.config import ModelConfig
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache


@partial(jax.jit, static_argnames=("config",))
def _step(params, tokens, positions, cache, *, config):
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    one_page = jnp.zeros((1, 1), jnp.int32)
    logits, cache = forward(
        params, tokens, positions, lengths, cache, one_page, config=config, attention="reference"
    )
    return logits[:, -1], cache


def greedy_generate(
    params,
    config: ModelConfig,
    prompt_ids: Sequence[int],
    max_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    *,
    return_logits: bool = False,
) -> list[int] | tuple[list[int], list[np.ndarray]]:
    """Greedy continuation of `prompt_ids`: at most `max_tokens` ids, stopping after an EOS id.

    With `return_logits`, also returns the float32 logits that chose each output token.
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
    cache = PagedKVCache.create(config, num_pages=1, page_size=total)
    tokens = jnp.asarray([list(prompt_ids)], jnp.int32)
    positions = jnp.arange(len(prompt_ids), dtype=jnp.int32)[None]
    logits, cache = _step(params, tokens, positions, cache, config=config)
    while True:
        token = int(jnp.argmax(logits[0]))
        out.append(token)
        all_logits.append(np.asarray(logits[0]))
        if token in eos_ids or len(out) == max_tokens:
            break
        position = len(prompt_ids) + len(out) - 1
        logits, cache = _step(
            params,
            jnp.asarray([[token]], jnp.int32),
            jnp.asarray([[position]], jnp.int32),
            cache,
            config=config,
        )
    return (out, all_logits) if return_logits else out
