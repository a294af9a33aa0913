"""The jitted programs an engine runs, as pure functions of device state and host arguments.

    programs = jit_programs(model_config, engine_config)   # `Programs`: one jitted fn per kind
    (tokens, logprobs), cache, last_tokens, history = programs.decode(
        params, rope, cache, last_tokens, history, slots, positions, page_table, sampling, steps)

Packed prefill (and its scoring form, which returns every position's logprobs, and its pooling
form, which samples nothing and returns embeddings' hidden states summed per chunk), the two decode
programs (length-following, and the batched einsum one for short contexts), a decode step split
in two halves for rows whose bitmask the host fills in between, speculative decoding's verify
step (a row's last token and its drafts scored in one pass, accepted on the device), extract and insert (a sequence's
KV out of and into the page pool), a slot's token history, and copying pages. Each compiles once
per shape bucket (`engine.config`); the page pool, `last_tokens` and the token history are
donated, so every program updates them in place. `engine.engine.Engine` holds the device state
and calls them; `engine.lowering` and `bench.tp_collectives` lower the same programs from shapes
alone. `sampling_rows` packs requests' settings into the sampling argument every program takes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from cadence.engine.config import EngineConfig
from cadence.model import cpu_kernels, paged_kv
from cadence.model.config import ModelConfig
from cadence.model.control import loop
from cadence.model.llama import forward
from cadence.model.paged_attention import writes_in_place
from cadence.model.paged_kv import PagedKVCache
from cadence.model.host_sampling import RequestSampling, SamplingParams, SamplingRows
from cadence.model.sampling import Logprobs, choose, logprobs_of
from cadence.model.sharding import TensorParallel


def _prefill_program(
    params, rope, cache, last_tokens, history, tokens, positions, lengths, tables, logit_index,
    row_chunk, steps, write_slot, sampling_slot, sampling, allowed, *, config, attention, dtype,
    mesh, max_logprobs,
):
    """Every chunk of a pack (`engine.packing`) in one pass: KV written through each row's
    table, one token sampled per chunk (with its slot's history, `sampling_slot`, among the
    tokens its bitmask `allowed` allows), and each
    prompt's last chunk's token written into its slot's `last_tokens` and counted into its
    history (other entries of `write_slot` are num_slots and drop out). Each row runs with its
    chunk's LoRA adapters (`sampling.lora`, gathered per chunk; `row_chunk` [rows] is each
    row's chunk, `packing.row_chunks`)."""
    with _live_rows(tokens, lengths):
        logits, cache = forward(
            params, tokens, positions, lengths, cache, tables, config=config,
            logit_index=logit_index, attention=attention, dtype=dtype, mesh=mesh, rope_table=rope,
            adapters=_row_adapters(sampling, row_chunk),
        )
    sampled, logprobs, last_tokens, history = _take_chunk_tokens(
        logits, last_tokens, history, steps, write_slot, sampling_slot, sampling, allowed, max_logprobs)
    return (sampled, logprobs), cache, last_tokens, history


def _row_adapters(sampling, row_chunk):
    """Each row's LoRA scales [rows, lora_slots]: its chunk's (`row_chunk`), and none for the
    rows past every chunk (a padding chunk's sampling row has none either)."""
    if sampling.lora.shape[-1] == 0:
        return None
    return jnp.take(sampling.lora, row_chunk, axis=0, mode="fill", fill_value=0)


def _live_rows(tokens, lengths):
    """A pack's chunks fill its rows from the first (`engine.packing`): the CPU kernels' matmuls
    over its positions compute them up to its last token and skip the rest of its bucket (and
    so does the scoring program's LM head over every position: the padding's logits come out
    zero, and nobody reads them). A prompt of 1-4 tokens (a draft model catching up with a
    verify step's tokens, a short turn) thus costs about a decode step, not a row of 16."""
    full = jnp.maximum(jnp.sum(lengths > 0, dtype=jnp.int32) - 1, 0)  # rows before the last one
    return cpu_kernels.live_rows(tokens.size, full * tokens.shape[1] + jnp.take(lengths, full))


def _take_chunk_tokens(logits, last_tokens, history, steps, write_slot, sampling_slot, sampling,
                       allowed, max_logprobs):
    """Both prefill programs' end: each chunk's token from its logits [C, vocab] (step = the
    new token's position), written into the slot of a prompt's last chunk and counted into its
    history."""
    sampled, logprobs, state = choose(logits, sampling, history, sampling_slot, steps, max_logprobs, allowed)
    last_tokens = last_tokens.at[write_slot].set(sampled, mode="drop")
    return sampled, logprobs, last_tokens, history.count(write_slot, sampled, sampling, state)


def _scored_prefill_program(
    params, rope, cache, last_tokens, history, tokens, positions, lengths, tables, logit_index,
    row_chunk, steps, write_slot, sampling_slot, sampling, allowed, targets, *, config, attention,
    dtype, mesh, max_logprobs,
):
    """`_prefill_program`, with the logits of every position of the pack: also returns each
    position's ranked `Logprobs` of `targets` [T] (its next token; -1 where none: ignored)."""
    every = jnp.arange(tokens.size, dtype=jnp.int32)
    with _live_rows(tokens, lengths):
        logits, cache = forward(
            params, tokens, positions, lengths, cache, tables, config=config, logit_index=every,
            attention=attention, dtype=dtype, mesh=mesh, rope_table=rope,
            adapters=_row_adapters(sampling, row_chunk),
        )
    sampled, logprobs, last_tokens, history = _take_chunk_tokens(
        logits[logit_index], last_tokens, history, steps, write_slot, sampling_slot, sampling,
        allowed, max_logprobs)
    scores = logprobs_of(logits, jnp.maximum(targets, 0), max_logprobs, jnp.ones(1, bool), ranked=True)
    return (sampled, logprobs, scores), cache, last_tokens, history


def _pooled_prefill_program(
    params, rope, cache, tokens, positions, lengths, tables, logit_index, row_chunk, *, config,
    attention, dtype, mesh,
):
    """A pack of embeddings' chunks: KV written as `_prefill_program` writes it, nothing
    sampled. Returns, per chunk ([C, D] float32 each), the sum of its positions' final hidden
    states (the final norm's output) and the one at its last token (`logit_index`); `row_chunk`
    [rows] is each row's chunk (`packing.row_chunks`). The host pools a prompt from its chunks'."""
    with _live_rows(tokens, lengths):
        hidden, cache = forward(
            params, tokens, positions, lengths, cache, tables, config=config, attention=attention,
            dtype=dtype, mesh=mesh, rope_table=rope, hidden=True,
        )
    row_sums = jnp.sum(jnp.where((positions >= 0)[..., None], hidden, 0.0), axis=1)  # [rows, D]
    sums = jax.ops.segment_sum(row_sums, row_chunk, num_segments=logit_index.shape[0])
    lasts = hidden.reshape(-1, hidden.shape[-1])[logit_index]
    return (sums, lasts), cache


def _decode_program(
    params, rope, cache, last_tokens, history, slots, positions, page_table, sampling, steps,
    *, config, attention, dtype, mesh, max_steps, max_logprobs,
):
    """Up to `steps` decode steps (at most `max_steps`) over the rows of `slots` [batch] (a
    slot index, or num_slots for a padding row); positions (each row's first step), page_table
    and sampling are per row. A row ends on the device when it samples one of its stop ids (or
    comes in with one, a request that ended in the step before): it writes nothing after, and
    on a CPU the loop exits once every row has ended (elsewhere it runs max_steps, the steps
    past that writing nothing: `model.control.loop`). Returns [max_steps, num_slots]: every slot's next
    token after each step (its last one where a row did not decode, and after the last step
    run, the state it left), and each step's `Logprobs` per slot (zeros where none was asked
    for or nothing decoded)."""
    num_slots = last_tokens.shape[0]
    inputs, live = _decode_inputs(last_tokens, slots, sampling)
    out = jnp.broadcast_to(last_tokens, (max_steps, num_slots))
    lp_out = _no_logprobs((max_steps, num_slots), max_logprobs)

    def more(state):
        step, live = state[:2]
        return (step < steps) & jnp.any(live)

    def one_step(state):
        step, live, inputs, cache, last_tokens, history, out, lp_out = state
        live = live & (step < steps)  # off the CPU the loop runs max_steps: the rest write nothing
        at = positions + step
        logits, cache = _decode_forward(params, rope, cache, inputs, live, at, page_table,
                                        sampling.lora, config=config, attention=attention,
                                        dtype=dtype, mesh=mesh)
        tokens, last_tokens, history, out, lp_out = _decode_sample(
            logits, live, inputs, slots, at, sampling, history, last_tokens, out, lp_out, step,
            max_logprobs=max_logprobs)
        return (step + 1, live & ~sampling.stops(tokens), tokens, cache, last_tokens, history, out,
                lp_out)

    ran, _, _, cache, last_tokens, history, out, lp_out = loop(
        more, one_step, (jnp.int32(0), live, inputs, cache, last_tokens, history, out, lp_out),
        max_steps)
    out = jnp.where((jnp.arange(max_steps) < ran)[:, None], out, last_tokens[None])
    return (out, lp_out), cache, last_tokens, history


def _verify_program(
    params, rope, cache, last_tokens, history, slots, positions, page_table, sampling, drafts,
    draft_lens, allowed, *, config, attention, dtype, mesh, max_logprobs,
):
    """Speculative decoding's step: each row scores `1 + d` positions (d = its draft count, at
    most k; a row with no drafts scores 1, as a decode step does): its last token at its
    position p, then its drafts at p + 1 .. p + d, causal among themselves, their KV written
    into the row's pages. Then, position by position, the row samples its own next token
    exactly as a decode step would there (the request's sampler keyed by the position, its
    penalties counting the tokens accepted before) and goes on while the sample equals the
    draft: it emits its accepted drafts and one token more (the target's own at the first
    mismatch, or after the last draft), so a step yields 1 .. d + 1 tokens, those plain
    decoding gives. A row also stops at one of its stop ids. The KV of positions past what a
    row accepted stays in its pages unread (attention reads up to a query's position) until
    the sequence gets there and overwrites it.

    Rows `slots` [batch] (num_slots: padding) at `positions` [batch] (each row's last
    token's position), their `drafts` [batch, k] of which the first `draft_lens` [batch] are
    real, and `allowed` [batch, k + 1, words]: at each position, the tokens the row's bitmask
    allows (a grammar's, advanced through the drafts before it; every bit set where none
    constrains it). Returns ((tokens [k + 1, num_slots], logprobs [k + 1, num_slots], emitted
    [num_slots]), cache, last_tokens, history): each slot's tokens in order (entries past what
    it emitted, and every entry of a slot not in `slots`, are its last token) and how many it
    emitted (0 for a slot that did not run)."""
    batch, k = drafts.shape
    num_slots = last_tokens.shape[0]
    inputs, live = _decode_inputs(last_tokens, slots, sampling)
    offsets = jnp.arange(k + 1, dtype=jnp.int32)
    lens = jnp.clip(draft_lens, 0, k)
    scored = live[:, None] & (offsets[None, :] <= lens[:, None])
    tokens = jnp.concatenate([inputs[:, None], drafts], axis=1)
    at = jnp.where(scored, positions[:, None] + offsets[None, :], -1)
    # Each scored position attends as a decode query of its own (`paged_attention.query_rows`).
    rows = attention if attention == "reference" else f"{attention}_rows"
    logits, cache = forward(
        params, tokens, at, jnp.where(live, lens + 1, 0), cache, page_table, config=config,
        attention=rows, dtype=dtype, mesh=mesh, rope_table=rope,
        adapters=sampling.lora)  # [batch, k + 1, vocab]

    into_none = jnp.full_like(slots, num_slots)
    drafts = jnp.concatenate([drafts, jnp.zeros((batch, 1), drafts.dtype)], axis=1)  # [batch, k + 1]

    def position(i, state):
        going, last_tokens, history, out, lp_out, emitted = state
        sampled, logprobs, state = choose(
            jax.lax.dynamic_index_in_dim(logits, i, 1, keepdims=False), sampling, history, slots,
            positions + i + 1, max_logprobs, jax.lax.dynamic_index_in_dim(allowed, i, 1, keepdims=False))
        into = jnp.where(going, slots, into_none)
        history = history.count(into, sampled, sampling, state)
        last_tokens = last_tokens.at[into].set(sampled, mode="drop")
        out = jax.lax.dynamic_update_index_in_dim(out, last_tokens, i, 0)
        lp_out = jax.tree.map(lambda a, new: a.at[i, into].set(new, mode="drop"), lp_out, logprobs)
        emitted = emitted.at[into].add(1, mode="drop")
        draft = jax.lax.dynamic_index_in_dim(drafts, i, 1, keepdims=False)
        going = going & (i < lens) & (sampled == draft) & ~sampling.stops(sampled)
        return going, last_tokens, history, out, lp_out, emitted

    state = (live, last_tokens, history, jnp.broadcast_to(last_tokens, (k + 1, num_slots)),
             _no_logprobs((k + 1, num_slots), max_logprobs), jnp.zeros(num_slots, jnp.int32))
    _, last_tokens, history, out, lp_out, emitted = jax.lax.fori_loop(0, k + 1, position, state)
    return (out, lp_out, emitted), cache, last_tokens, history


def _decode_inputs(last_tokens, slots, sampling):
    """Each row's input token, and whether it decodes: a real slot (not padding, num_slots)
    whose input is not one of its stop ids (a request that ended in the step before)."""
    inputs = jnp.take(last_tokens, slots, mode="clip")
    return inputs, (slots < last_tokens.shape[0]) & ~sampling.stops(inputs)


def _no_logprobs(shape, max_logprobs):
    return Logprobs(token=jnp.zeros(shape, jnp.float32),
                    ids=jnp.zeros((*shape, max_logprobs), jnp.int32),
                    values=jnp.zeros((*shape, max_logprobs), jnp.float32))


def _decode_forward(params, rope, cache, inputs, live, at, page_table, adapters, *, config,
                    attention, dtype, mesh):
    """One decode step's forward pass: each live row's KV at `at` written, its logits (with
    its LoRA `adapters`' scales)."""
    rows = jnp.arange(inputs.shape[0], dtype=jnp.int32)
    return forward(params, inputs[:, None], at[:, None], live.astype(jnp.int32), cache, page_table,
                   config=config, logit_index=rows, attention=attention, dtype=dtype, mesh=mesh,
                   rope_table=rope, adapters=adapters)


def _decode_sample(logits, live, inputs, slots, at, sampling, history, last_tokens, out, lp_out,
                   step, *, max_logprobs, allowed=None):
    """One decode step's sampling: each live row's token (its input where it does not decode)
    written into its slot's `last_tokens`, counted into its history, and recorded as step
    `step` of `out` and `lp_out`."""
    num_slots = last_tokens.shape[0]
    sampled, logprobs, state = choose(logits, sampling, history, slots, at + 1, max_logprobs, allowed)
    tokens = jnp.where(live, sampled, inputs)
    into = jnp.where(live, slots, num_slots)
    last_tokens = last_tokens.at[into].set(tokens, mode="drop")
    history = history.count(into, tokens, sampling, state)
    out = jax.lax.dynamic_update_index_in_dim(out, last_tokens, step, 0)
    lp_out = jax.tree.map(lambda a, new: a.at[step, into].set(new, mode="drop"), lp_out, logprobs)
    return tokens, last_tokens, history, out, lp_out


def _decode_forward_program(params, rope, cache, last_tokens, slots, positions, page_table, sampling,
                            *, config, attention, dtype, mesh):
    """The first half of a decode step whose sampling waits for the host (a grammar's bitmask,
    filled from the token the step before sampled): the forward pass of `_decode_program`'s
    first step, returning the logits [batch, vocab] that `_decode_sample_program` samples."""
    inputs, live = _decode_inputs(last_tokens, slots, sampling)
    return _decode_forward(params, rope, cache, inputs, live, positions, page_table, sampling.lora,
                           config=config, attention=attention, dtype=dtype, mesh=mesh)


def _decode_sample_program(logits, last_tokens, history, slots, positions, sampling, allowed, *,
                           max_logprobs):
    """The second half: the step's tokens from `logits`, each row among those its bitmask
    `allowed` [batch, words] allows, as `_decode_program` returns one step's ([1, num_slots]).
    A row whose slot is num_slots here (its request ended while the forward ran) writes
    nothing; its KV, written by the forward, is in pages it no longer holds."""
    num_slots = last_tokens.shape[0]
    inputs, live = _decode_inputs(last_tokens, slots, sampling)
    _, last_tokens, history, out, lp_out = _decode_sample(
        logits, live, inputs, slots, positions, sampling, history, last_tokens,
        last_tokens[None], _no_logprobs((1, num_slots), max_logprobs), 0,
        max_logprobs=max_logprobs, allowed=allowed)
    return (out, lp_out), last_tokens, history


def _copy_program(cache, sources, targets, *, cpu_kernel=False):
    """Copies pages `sources` [W] onto pages `targets` [W] in every layer (a target past the
    pool, padding, writes nothing); `cpu_kernel`: in place, by the kernels
    (`paged_kv.copy_pages`)."""
    return PagedKVCache(k=paged_kv.copy_pages(cache.k, sources, targets, cpu_kernel=cpu_kernel),
                        v=paged_kv.copy_pages(cache.v, sources, targets, cpu_kernel=cpu_kernel))


def _history_program(history, slot, tokens, prompt_len, window, breakers, match, sampler):
    """Writes slot `slot`'s token history from its sequence so far (`TokenHistory.set_row`)."""
    return history.set_row(slot, tokens, prompt_len, window, breakers, match, sampler)


def _sampler_program(history, slot):
    """Slot `slot`'s sampler state, [SAMPLER_STATE], apart from the history (which the next
    program takes over): read after every program dispatched before it. Donates nothing."""
    return history.sampler[slot]


def _extract_program(cache, last_tokens, ids, slot):
    """The pages `ids` [P] of every layer, stacked: k, v [layers, kv_heads, P, page_size, d],
    and `slot`'s next decode input. Reads only: nothing is donated."""
    def take(pool):
        if cache.stacked:
            return jnp.take(pool, ids, axis=2, mode="clip")
        return jnp.stack([jnp.take(layer, ids, axis=1, mode="clip") for layer in pool])

    return take(cache.k), take(cache.v), last_tokens[slot]


def _insert_program(cache, last_tokens, k, v, ids, slot, token, *, cpu_kernel=False):
    """Writes a handle's pages into pages `ids` [P] (an id past the pool, padding, writes
    nothing) and makes `token` the slot's next decode input (a slot past the buffer: nobody's);
    `cpu_kernel`: in place, by the kernels (`paged_kv.insert_pages`)."""
    cache = PagedKVCache(k=paged_kv.insert_pages(cache.k, k, ids, cpu_kernel=cpu_kernel),
                         v=paged_kv.insert_pages(cache.v, v, ids, cpu_kernel=cpu_kernel))
    return cache, last_tokens.at[slot].set(token, mode="drop")


@dataclasses.dataclass(frozen=True)
class Programs:
    """An engine's jitted programs (each compiles once per shape bucket)."""

    prefill: Callable
    prefill_scored: Callable  # prefill with every position's logprobs (echo), a chunk at a time
    prefill_pooled: Callable  # embeddings' prefill: hidden states summed per chunk, nothing sampled
    decode: Callable  # the length-following decode
    decode_batched: Callable  # the einsum decode over a page-table bucket
    # A decode step in two halves, for rows whose bitmask the host fills in between: the
    # forward pass (length-following, and batched) and the sampling.
    decode_forward: Callable
    decode_forward_batched: Callable
    decode_sample: Callable
    extract: Callable
    insert: Callable
    history: Callable  # a slot's TokenHistory row from its tokens
    sampler: Callable  # a slot's sampler state, read out
    copy: Callable  # pages onto other pages
    verify: Callable  # speculative decoding: each row's last token and drafts scored at once


def jit_programs(model_config: ModelConfig, config: EngineConfig,
                 tp: TensorParallel | None = None) -> Programs:
    """The programs an engine runs, for `model_config` as computed (KV heads repeated, under
    `tp`). With `tp`, every output is pinned to where its input lives (the pool by KV head,
    tokens replicated), so each donated buffer is updated in place on every device.
    `bench.tp_collectives` lowers the same programs from shapes alone."""
    if tp is not None:
        model_config = tp.compute_config  # the KV heads as the plan repeats them
    static = dict(config=model_config, attention=config.attention, dtype=jnp.dtype(config.dtype),
                  mesh=tp.attention_mesh if tp else None, max_logprobs=config.max_logprobs)
    decode = dict(static, max_steps=config.decode_steps)
    forward_only = {k: v for k, v in static.items() if k != "max_logprobs"}
    donate = ("cache", "last_tokens", "history")

    def jit(fn, out, **kw):
        if config.decode_matmul == "cpu":  # traced with the CPU kernels' activations and argmax
            fn = cpu_kernels.with_activations(fn, config.cpu_activations)
        return jax.jit(fn, **({} if tp is None else {"out_shardings": out}), **kw)

    # The kernels write the pool (`paged_kv`); a tensor-parallel pool is XLA's to scatter, by
    # KV head, where a kernel call outside `sharding.per_head` would gather it whole.
    in_place = writes_in_place(config.attention) and tp is None
    pool, token, handle = (None, None, None) if tp is None else (
        tp.pool_sharding, tp.replicated, tp.handle_sharding)
    stepped = (token, pool, token, token)  # (tokens, logprobs), pool, last_tokens, history
    # Page-table widths are shapes: each bucket is its own program, compiled at warm-up.
    return Programs(
        prefill=jit(functools.partial(_prefill_program, **static), stepped, donate_argnames=donate),
        prefill_scored=jit(functools.partial(_scored_prefill_program, **static), stepped,
                           donate_argnames=donate),
        prefill_pooled=jit(functools.partial(_pooled_prefill_program, **forward_only),
                           ((token, token), pool), donate_argnames=("cache",)),
        decode=jit(functools.partial(_decode_program, **decode), stepped, donate_argnames=donate),
        decode_batched=jit(functools.partial(_decode_program, **{**decode, "attention": "reference"}),
                           stepped, donate_argnames=donate),
        decode_forward=jit(functools.partial(_decode_forward_program, **forward_only), (token, pool),
                           donate_argnames=("cache",)),
        decode_forward_batched=jit(
            functools.partial(_decode_forward_program, **{**forward_only, "attention": "reference"}),
            (token, pool), donate_argnames=("cache",)),
        decode_sample=jit(functools.partial(_decode_sample_program, max_logprobs=config.max_logprobs),
                          (token, token, token), donate_argnames=("last_tokens", "history")),
        extract=jit(_extract_program, (handle, handle, token)),
        insert=jit(functools.partial(_insert_program, cpu_kernel=in_place), (pool, token),
                   donate_argnames=("cache", "last_tokens")),
        history=jit(_history_program, token, donate_argnames=("history",)),
        sampler=jit(_sampler_program, token),
        copy=jit(functools.partial(_copy_program, cpu_kernel=in_place), pool, donate_argnames=("cache",)),
        verify=jit(functools.partial(_verify_program, **static), stepped, donate_argnames=donate),
    )


def sampling_rows(rows: Sequence[RequestSampling], lora_slots: int = 0) -> SamplingParams:
    return SamplingRows.of(list(rows), lora_slots).params()
