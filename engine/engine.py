"""Device state and the compiled programs: weights, the KV page pool, bucketed prefill, decode.

The engine owns everything that lives on the device. It implements `engine.api.EngineAPI`, the
whole of what the scheduler may use; its two programs:

    tokens = engine.prefill(chunks, sampling_rows)    # every prompt chunk of an iteration, packed
    tokens = engine.decode(positions, active, sampling_rows, page_table, steps)  # the active slots,
                                                      # `steps` steps (default 1) in one program

and the calls that move a sequence's KV out of one engine and into another (`KVHandle`):

    handle = engine.extract(pages, length, slot)      # its pages' contents and next token
    landed = other.receive(handle)                    # the copy to the other engine's device
    other.insert(landed, pages, slot)                 # into free pages of that engine

Both return device arrays immediately (JAX dispatch is asynchronous) and have already started
copying them to the host; the scheduler reads them one step later, so the device never waits
for Python between steps. The token each slot decodes next never leaves the device: prefill
(final chunk) and decode write it into `last_tokens`, which the next decode reads.

KV lives in a pool of fixed-size pages (`model.paged_kv`) shared by every sequence; which pages a
sequence holds is the scheduler's business (`scheduler.pages`), passed in as page tables, so KV
memory follows the tokens that exist and `num_slots` (sequences in flight) no longer multiplies
`max_seq_len`. Shapes are fixed per program: prefill compiles once per packed-token bucket (and
per page-table bucket for the reference attention), decode once per (batch bucket, page-table
bucket), extract and insert once per page-count bucket, where the page bucket is the width
of the page table passed, which bounds what attention reads, and the batch bucket is the
smallest power of two holding the active slots: decode gathers their rows, runs only those, and
scatters the tokens back, so one stream on an idle engine pays for one row, not `num_slots` (vLLM
captures one CUDA graph per padded batch size for the same reason). Everything that varies per
request is an array argument. The pool and `last_tokens` are donated into every program, so
they are updated in place. `warmup()` compiles every program (or, with warmup="needed", those
every request runs: the rest compile on first use, off the scheduler's thread, `prepare`);
afterwards `compilations_after_warmup` must stay 0.

The pieces it is built from live beside it: its configuration and shape buckets in
`engine.config`, the jitted programs in `engine.programs`, what its calls return (`KVHandle`,
`PrefillTokens`, `DecodeTokens`) in `engine.results`, and warm-up's list of programs and its
compiling in `engine.warmup` (`Compiling`, mixed in), and its calls on a slot's KV and history
besides the steps in `engine.kv_ops` (`KVOps`, mixed in).

On the CPU, decode can run cadence's own kernels (`model.cpu_kernels`): `attention="cpu"` for
its attention and `decode_matmul="cpu"` for its matmuls, which read the weights in the kernel's
blocked layout (GGUF's own blocks where `packed` gives them). Then every program reads that one
tree: prefill's many rows take XLA's GEMM over each matrix dequantized in turn
(`cpu_kernels.matmul`), and no [in, out] float copy of the weights is kept.

With several `devices` the engine is tensor parallel (`model.sharding`): the same programs,
partitioned by XLA over the mesh, with attention run per device over its own heads.

Speculative decoding's verify step (`verify`) scores each row's last token and its drafts in
one pass and keeps, on the device, the drafts the row's own sampler agrees with.

Non-goals here: pipeline parallelism, prefix sharing (the scheduler's pages do it).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from cadence.engine import compile_counter
from cadence.engine.config import EngineConfig
from cadence.engine.kv_ops import KVOps
from cadence.engine.lora_bank import LoraBank
from cadence.engine.packing import Pack, PrefillChunk, bucket_for, pack_chunks, row_chunks
from cadence.engine.programs import jit_programs
from cadence.engine.results import DecodeTokens, PrefillTokens
from cadence.engine.warmup import Compiling, spec
from cadence.model import cpu_kernels, layer_loop
from cadence.model.config import ModelConfig
from cadence.model.llama import rope_table
from cadence.model.lora import LoraAdapter
from cadence.model.params import cast
from cadence.model.sharding import TensorParallel
from cadence.model.paged_kv import PagedKVCache
from cadence.model.host_sampling import SamplingParams, SamplingRows, gather_allowed
from cadence.model.sampling import Logprobs, TokenHistory


@functools.cache
def _greedy_row(lora_slots: int) -> SamplingParams:
    """What a padding row samples with (read only)."""
    return SamplingRows(1, lora_slots).params()


def _gather_rows(sampling: SamplingParams, pick: np.ndarray, live: np.ndarray,
                 lora_slots: int) -> SamplingParams:
    """The sampling rows of the slots `pick`; padding rows (not `live`) are greedy, so they
    never send a step down the sampling path (and use no LoRA adapter). The rows must carry
    the engine's `lora_slots` scales each (another width would be another program)."""
    if np.shape(sampling.lora)[-1] != lora_slots:
        raise ValueError(f"sampling rows carry {np.shape(sampling.lora)[-1]} LoRA scales each; this "
                         f"engine's bank has {lora_slots} slots (SamplingRows(num_slots, lora_slots))")
    greedy_row = _greedy_row(lora_slots)

    def gather(a, greedy):
        rows = live.reshape(live.shape + (1,) * (greedy.ndim - 1))
        return np.where(rows, np.asarray(a)[pick], greedy).astype(greedy.dtype)

    return jax.tree.map(gather, sampling, greedy_row)


def _placed_as_stored(path) -> bool:
    """Whether a single-device engine places a params leaf in the dtype it comes in: the CPU
    kernels' blocks (a checkpoint's 16-bit floats are read as they are), and an embedding table,
    of which a lookup converts only the rows it takes (an untied 16-bit table stays 16-bit).
    Every other leaf is cast to the compute dtype."""
    return cpu_kernels.is_blocked(path) or str(getattr(path[-1], "key", "")) == "embedding"


def cpu_weights(params, packed, model_config: ModelConfig, config: EngineConfig) -> tuple[dict, bool]:
    """The tree an engine on the CPU kernels reads (`cpu_kernels.decode_params` over `params`
    and `packed`), its layers stacked where they run as one loop (`EngineConfig.layer_loop`),
    and whether they do. Given such a tree already stacked (`layer_loop.is_stacked`: a
    disaggregated pair's, made once so that both engines place the same buffers), that tree."""
    loop = config.layer_loop and config.attention == "cpu"
    if layer_loop.is_stacked(params):
        if packed or not loop:
            raise ValueError("a tree of stacked layers runs on the layer loop (attention='cpu', "
                             "layer_loop=True), without packed matrices beside it")
        return params, True
    tree = cpu_kernels.decode_params(params, packed, model_config.num_layers if loop else None)
    reason = layer_loop.unstackable(tree, model_config.num_layers) if loop else None
    if reason:
        logging.info("the layers run unrolled, not as one loop: %s", reason)
    if not loop or reason:
        return tree, False
    return layer_loop.stack_layers(tree, model_config.num_layers), True


def _copy_to_host(logprobs: Logprobs) -> None:
    for a in (logprobs.token, logprobs.ids, logprobs.values):
        a.copy_to_host_async()


def _local(tokens: jax.Array) -> jax.Array:
    """This process's copy of replicated tokens: the array itself on one host; across hosts
    (`engine.multihost`) the whole array is never addressable here, its local copy is."""
    return tokens if tokens.is_fully_addressable else tokens.addressable_data(0)


@dataclasses.dataclass(frozen=True)
class _DecodeBatch:
    """A decode call's rows: `rows` [batch] the slots (num_slots: padding), `live` which are
    real, `pick` a valid slot index per row, each row's first position and page table, whether
    the batched program runs, and the active slots."""

    rows: np.ndarray
    live: np.ndarray
    pick: np.ndarray
    positions: np.ndarray
    tables: np.ndarray
    batched: bool
    slots: np.ndarray


@dataclasses.dataclass(frozen=True)
class _PendingStep:
    """A decode step between its halves: its batch, the sampling rows (per slot, and gathered
    per row) and its logits on the device."""

    batch: _DecodeBatch
    sampling: SamplingParams
    gathered: SamplingParams
    logits: jax.Array



class Engine(KVOps, Compiling, LoraBank):
    """See the module's docstring. Its calls on a slot's KV and history besides the steps
    (page copies, token histories, KV moves, recovery) are `engine.kv_ops.KVOps`; warm-up and
    compiling on first use, `engine.warmup.Compiling`; its LoRA adapters' bank,
    `engine.lora_bank.LoraBank`."""

    def __init__(self, params, model_config: ModelConfig, config: EngineConfig = EngineConfig(),
                 device: jax.Device | None = None, devices: Sequence[jax.Device] | None = None,
                 packed: Mapping[tuple[str, ...], np.ndarray] | None = None,
                 adapters: Sequence[LoraAdapter] = ()):
        """`device`: where the weights, the pool and every program live (default: the first).
        Everything the engine holds is committed to it, so programs run there whatever device
        a `KVHandle` or an argument comes from.

        `devices` (more than one): tensor parallelism over them (`model.sharding`): each holds
        its shards of the weights and of the page pool, every program runs on all of them as
        one SPMD program, and `self.tp` says how the model was split.

        `packed`: matrices in a grouped block-quantized format (`model.block_layout.pack_grouped`,
        GGUF's own blocks: `LoadedModel.packed`), by path, that decode_matmul="cpu" reads in
        place of blocking their float matrices (their leaves in `params` are not read, and may
        be anything of the right shape).

        `adapters`: LoRA adapters (`model.lora`) for the bank of `config.lora_slots` slots,
        adapter i in slot i; a request uses them through its sampling row's `lora` scales. The
        bank holds the projections they change, or all of them where slots are left free (for
        `set_adapter`)."""
        if config.max_seq_len > model_config.max_context:
            raise ValueError(
                f"max_seq_len {config.max_seq_len} exceeds the model's context of "
                f"{model_config.max_context} tokens"
            )
        compile_counter.install()
        if device is not None and devices is not None:
            raise ValueError("pass one device, or the devices of a tensor-parallel mesh, not both")
        self.model_config = model_config
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.stacked_layers = False  # the layers run as one loop (`model.layer_loop`)
        self.tp = TensorParallel.plan(model_config, devices) if devices and len(devices) > 1 else None
        if self.tp is None:
            self.device = device or (devices[0] if devices else jax.devices()[0])
            if config.decode_matmul == "cpu" and self.device.platform == "cpu":
                params, self.stacked_layers = cpu_weights(params, packed, model_config, config)
            elif packed:
                raise ValueError("packed matrices are read by decode_matmul='cpu' only")
            self.params = jax.tree_util.tree_map_with_path(
                lambda path, a: (jax.device_put(a, self.device) if _placed_as_stored(path)
                                 else cast(jax.device_put(a, self.device), dtype)), params)
            # What the programs run: the model as given, or with KV heads repeated (sharding).
            self.compute_config = model_config
            self._pool_at = self._token_at = self._handle_at = self.device
        else:
            self.device = devices[0]
            self.params = self.tp.place(params, dtype)
            self.compute_config = self.tp.compute_config
            self._pool_at, self._token_at = self.tp.pool_sharding, self.tp.replicated
            self._handle_at = self.tp.handle_sharding
            logging.info("%s", self.tp.describe())
        self._place_lora_bank(adapters)
        if config.decode_matmul == "cpu" and (self.tp is not None or self.device.platform != "cpu"):
            raise ValueError("decode_matmul='cpu' runs on one CPU device; use 'xla' with tensor "
                             "parallelism or an accelerator")
        # cos and sin of every position a slot holds, looked up by both programs
        self.rope = jax.device_put(rope_table(self.compute_config, config.max_seq_len), self._token_at)
        self.cache: PagedKVCache | None = None
        self.last_tokens: jax.Array | None = None
        self.history: TokenHistory | None = None
        self.recover()  # allocates the page pool, the next-token buffer and the token history
        programs = self._programs = jit_programs(self.compute_config, config, self.tp)
        self._prefill, self._decode = programs.prefill, programs.decode
        self._prefill_scored = programs.prefill_scored
        self._prefill_pooled = programs.prefill_pooled
        self._decode_batched = programs.decode_batched
        self._decode_forward, self._decode_sample = programs.decode_forward, programs.decode_sample
        self._decode_forward_batched = programs.decode_forward_batched
        self._pending: _PendingStep | None = None  # a decode_forward awaiting its decode_sample
        self._extract, self._insert = programs.extract, programs.insert
        self._history, self._sampler = programs.history, programs.sampler
        self._copy = programs.copy
        self._verify = programs.verify
        self._warm_compiles: int | None = None
        self._warm_on_demand = 0
        # What `prepare` compiles from: every device buffer as a shape, dtype and sharding.
        self._specs = jax.tree.map(spec, (self.params, self.rope, self.cache,
                                           self.last_tokens, self.history))
        self._handle_sharding = (jax.sharding.SingleDeviceSharding(self._handle_at)
                                 if isinstance(self._handle_at, jax.Device) else self._handle_at)
        self._lock = threading.Lock()
        self._ready: set[str] = set()  # the groups warm-up or `prepare` compiled
        self._compiling: dict[str, Future] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="cadence-compile-on-demand")
        logging.info(
            "KV pool: %d pages x %d tokens (%d tokens), %.1f MiB", self.num_pages, config.page_size,
            self.num_pages * config.page_size, self.cache.nbytes / 2**20,
        )

    # -- the two programs -------------------------------------------------------------------

    def prefill(self, chunks: Sequence[PrefillChunk], sampling: SamplingParams,
                allowed: np.ndarray | None = None) -> PrefillTokens:
        """Writes every chunk's KV and samples one token per chunk, normally in one program
        (`engine.packing`); `sampling` holds every slot's row ([num_slots], as for decode), and
        `allowed` every slot's token bitmask ([num_slots, words] int32; None: every token).

        A prompt's last chunk (`final`) makes its token the request's first output and its
        slot's next decode input. Returns at once: `np.asarray(result)[i]` is chunk i's token.
        """
        cfg = self.config
        self._check_role("prefill")
        for c in chunks:
            n = len(c.tokens)
            if not 0 < n <= cfg.prefill_chunk:
                raise ValueError(f"a prefill chunk must hold 1..{cfg.prefill_chunk} tokens, got {n}")
            if c.start < 0 or c.start + n > cfg.max_seq_len:
                raise ValueError(f"chunk [{c.start}, {c.start + n}) overflows max_seq_len={cfg.max_seq_len}")
            self._check(c.slot, c.pages, cfg.pages_for(c.start + n))
        plain = [i for i, c in enumerate(chunks) if c.targets is None and not c.pooled]
        scored = [i for i, c in enumerate(chunks) if c.targets is not None]
        pooled = [i for i, c in enumerate(chunks) if c.pooled]
        if any(c.pooled and c.targets is not None for c in chunks):
            raise ValueError("a pooled chunk scores nothing: it has no targets")
        pack = functools.partial(
            pack_chunks, block=cfg.pack_block, page_buckets=cfg.prefill_page_buckets,
            page_size=cfg.page_size, num_slots=cfg.num_slots, max_chunks=cfg.chunks_per_program)
        results, logprobs, scores = [], [], {}
        wanted = bool(np.asarray(sampling.logprobs).any())

        def run(p: Pack, targets: np.ndarray | None = None):
            live = p.sampling_slot < cfg.num_slots
            pick = np.where(live, p.sampling_slot, 0)
            tokens, lp, *score = self._run_pack(
                p, _gather_rows(sampling, pick, live, cfg.lora_slots),
                gather_allowed(allowed, (cfg.num_slots,), self.vocab_size, pick, live), targets)
            tokens.copy_to_host_async()
            if wanted:
                _copy_to_host(lp)
            results.append((tokens, p.count))
            logprobs.append(lp)
            return score

        for p in pack([chunks[i] for i in plain], token_buckets=cfg.prefill_buckets) if plain else []:
            run(p)
        if scored:
            self._ensure("scoring")
        for i in scored:  # a chunk whose every position is scored runs alone, in its program
            p = pack([chunks[i]], token_buckets=cfg.score_buckets)[0]
            targets = np.full(p.tokens.size, -1, np.int32)
            targets[: len(chunks[i].targets)] = np.asarray(chunks[i].targets, np.int32)
            (score,) = run(p, targets)
            _copy_to_host(score)
            scores[i] = (score, len(chunks[i].tokens))
        return PrefillTokens(results, logprobs, order=plain + scored, scores=scores,
                             pooled=self._prefill_pooled_chunks([chunks[i] for i in pooled], pooled, pack))

    def _prefill_pooled_chunks(self, chunks: Sequence[PrefillChunk], indices: Sequence[int],
                               pack) -> dict[int, tuple[tuple[jax.Array, jax.Array], int]]:
        """Embeddings' chunks, packed together in the pooling program: {chunk index: (that
        program's (sums, lasts), the chunk's row in them)}."""
        if not chunks:
            return {}
        self._ensure("pooling")
        out, at = {}, 0
        for p in pack(chunks, token_buckets=self.config.prefill_buckets):
            pooled, self.cache = self._prefill_pooled(
                self.params, self.rope, self.cache, p.tokens, p.positions, p.lengths, p.tables,
                p.logit_index, row_chunks(p))
            pooled = jax.tree.map(_local, pooled)
            for a in pooled:
                a.copy_to_host_async()
            for row in range(p.count):
                out[indices[at + row]] = (pooled, row)
            at += p.count
        return out

    def _run_pack(self, pack: Pack, sampling: SamplingParams, allowed: np.ndarray,
                  targets: np.ndarray | None = None):
        """(tokens, logprobs), and with `targets` the scoring program's, and its scores."""
        args = (self.params, self.rope, self.cache, self.last_tokens, self.history, pack.tokens,
                pack.positions, pack.lengths, pack.tables, pack.logit_index, row_chunks(pack),
                pack.steps, pack.write_slot, pack.sampling_slot, sampling, allowed)
        if targets is None:
            out, self.cache, self.last_tokens, self.history = self._prefill(*args)
        else:
            out, self.cache, self.last_tokens, self.history = self._prefill_scored(*args, targets)
        tokens, *rest = out
        return (_local(tokens), *(jax.tree.map(_local, x) for x in rest))

    def decode(
        self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
        page_table: np.ndarray, steps: int = 1,
    ) -> DecodeTokens:
        """`steps` decode steps over the active slots in one program: slot s consumes its last
        token at `positions[s]` and samples the next, then the next at positions[s] + 1, and so
        on, with its sequence's pages in `page_table[s]` ([num_slots, max_pages_per_seq] int32,
        enough for positions[s] + steps tokens). A slot stops early, on the device, at one of
        its stop ids (`SamplingParams.stop_ids`). Returns at once: `np.asarray(result)` is
        [steps, num_slots], every slot's next token after each step (an inactive slot's: its
        last token; a stopped slot's: its stop token).

        Runs the smallest batch bucket holding the active slots: their rows are gathered here,
        on the host (a few hundred bytes), and padded with rows that write nothing."""
        if not 1 <= steps <= self.config.decode_steps:
            raise ValueError(f"a decode call runs 1..{self.config.decode_steps} steps "
                             f"(decode_steps), got {steps}")
        batch = self._decode_batch(positions, active, page_table, steps)
        program = self._decode_batched if batch.batched else self._decode
        (tokens, logprobs), self.cache, self.last_tokens, self.history = program(
            self.params, self.rope, self.cache, self.last_tokens, self.history, batch.rows,
            batch.positions, batch.tables,
            _gather_rows(sampling, batch.pick, batch.live, self.config.lora_slots), np.int32(steps),
        )
        return self._decode_result(tokens, logprobs, steps, sampling, batch)

    def verify(self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
               page_table: np.ndarray, drafts: np.ndarray, draft_lens: np.ndarray,
               allowed: np.ndarray | None = None) -> DecodeTokens:
        """Speculative decoding's step over the active slots: slot s consumes its last token at
        `positions[s]` and its first `draft_lens[s]` drafts `drafts[s]` ([num_slots, k] int32, k
        = speculative_tokens) at the positions after, in one pass, and keeps the drafts its own
        sampler agrees with, and one token more (`engine.programs._verify_program`): the tokens
        `decode` would give, 1 .. draft_lens[s] + 1 of them. Its page table must hold positions
        up to positions[s] + draft_lens[s]. Returns at once: `np.asarray(result)` is [k + 1,
        num_slots], `result.emitted()` how many of each column are real (0 for an inactive
        slot). At most `speculative_batch` slots; needs speculative_tokens > 0. `allowed`
        ([num_slots, k + 1, words] int32; None: every token) is each slot's bitmask at each of
        its positions, its grammar's after the drafts before (`grammar.Matcher.draft_masks`)."""
        cfg = self.config
        k = cfg.speculative_tokens
        if k == 0:
            raise ValueError("this engine was built without speculative_tokens: it has no verify "
                             "program")
        drafts, draft_lens = np.asarray(drafts, np.int32), np.asarray(draft_lens, np.int32)
        if drafts.shape != (cfg.num_slots, k) or draft_lens.shape != (cfg.num_slots,):
            raise ValueError(f"drafts are int32 [{cfg.num_slots}, {k}] and draft_lens "
                             f"[{cfg.num_slots}], got {list(drafts.shape)} and {list(draft_lens.shape)}")
        if draft_lens.min() < 0 or draft_lens.max() > k:
            raise ValueError(f"draft_lens must be in [0, {k}]")
        if np.count_nonzero(active) > cfg.speculative_batch:
            raise ValueError(f"a verify step runs up to {cfg.speculative_batch} slots "
                             f"(speculative_batch), got {np.count_nonzero(active)}")
        if ((drafts < 0) | (drafts >= self.vocab_size)).any():
            raise ValueError(f"draft tokens must be in [0, {self.vocab_size})")
        slots = np.flatnonzero(active)
        reach = positions[slots] + draft_lens[slots] + 1
        batch = self._decode_batch(positions, active, page_table, 1, reach=reach,
                                   batch_buckets=cfg.verify_batch_buckets,
                                   page_buckets=cfg.verify_page_buckets)
        self._ensure("speculative")
        (tokens, logprobs, emitted), self.cache, self.last_tokens, self.history = self._verify(
            self.params, self.rope, self.cache, self.last_tokens, self.history, batch.rows,
            batch.positions, batch.tables, _gather_rows(sampling, batch.pick, batch.live, cfg.lora_slots),
            np.where(batch.live[:, None], drafts[batch.pick], 0).astype(np.int32),
            np.where(batch.live, draft_lens[batch.pick], 0).astype(np.int32),
            gather_allowed(allowed, (cfg.num_slots, k + 1), self.vocab_size, batch.pick, batch.live))
        return self._decode_result(tokens, logprobs, k + 1, sampling, batch, emitted)

    def decode_forward(self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
                       page_table: np.ndarray) -> None:
        """The first half of one decode step (`decode`'s arguments, one step), for a batch
        whose bitmasks the host fills from the tokens of the step before, while this runs: the
        forward pass, its KV written and its logits kept on the device for `decode_sample`,
        which must be the next decode call. Returns at once. Needs `structured_output`."""
        if not self.config.structured_output:
            raise ValueError("this engine was built without structured_output: its decode steps "
                             "cannot be split to take a bitmask")
        if self._pending is not None:
            raise ValueError("decode_forward twice: decode_sample the step in flight first")
        self._ensure("structured")
        batch = self._decode_batch(positions, active, page_table, 1)
        program = self._decode_forward_batched if batch.batched else self._decode_forward
        gathered = _gather_rows(sampling, batch.pick, batch.live, self.config.lora_slots)
        logits, self.cache = program(self.params, self.rope, self.cache, self.last_tokens,
                                     batch.rows, batch.positions, batch.tables, gathered)
        self._pending = _PendingStep(batch, sampling, gathered, logits)

    def decode_sample(self, allowed: np.ndarray, drop: Sequence[int] = ()) -> DecodeTokens:
        """The second half: the step's tokens, each active slot's among those its bitmask
        (`allowed` [num_slots, words] int32) allows, as `decode(..., steps=1)` returns them.
        The slots in `drop` (their requests ended while the forward ran) take no token, and
        their entries are their last tokens. Returns at once."""
        pending = self._pending
        if pending is None:
            raise ValueError("decode_sample without a decode_forward before it")
        batch = pending.batch
        masks = gather_allowed(allowed, (self.config.num_slots,), self.vocab_size, batch.pick,
                               batch.live)
        rows = np.where(np.isin(batch.rows, np.asarray(drop, np.int32)), self.config.num_slots,
                        batch.rows).astype(np.int32)
        self._pending = None
        (tokens, logprobs), self.last_tokens, self.history = self._decode_sample(
            pending.logits, self.last_tokens, self.history, rows, batch.positions, pending.gathered,
            masks)
        return self._decode_result(tokens, logprobs, 1, pending.sampling, batch)

    def _decode_batch(self, positions: np.ndarray, active: np.ndarray, page_table: np.ndarray,
                      steps: int, reach: np.ndarray | None = None,
                      batch_buckets: tuple[int, ...] | None = None,
                      page_buckets: tuple[int, ...] | None = None) -> _DecodeBatch:
        """The active slots' rows, in the smallest batch bucket that holds them, their page
        tables cut to the width the positions they write up to (`reach`, exclusive; default
        their positions + `steps`) need: decode's plan, or a bucket of `page_buckets`."""
        cfg = self.config
        self._check_role("decode")
        if self._pending is not None:
            raise ValueError("a decode step's sampling is still to run (decode_sample)")
        slots = np.flatnonzero(active)
        reach = positions[slots] + steps if reach is None else reach
        if slots.size and int(reach.max()) > cfg.max_seq_len:
            raise ValueError(f"positions up to {int(reach.max()) - 1} overflow "
                             f"max_seq_len={cfg.max_seq_len}")
        rows = np.full(bucket_for(batch_buckets or cfg.decode_batch_buckets, max(len(slots), 1)),
                       cfg.num_slots, np.int32)  # padding: a slot index past the last
        rows[: len(slots)] = slots
        live = rows < cfg.num_slots
        pick = np.where(live, rows, 0)
        if page_buckets is None:
            batched, width = self._decode_plan(reach)
        else:
            batched = False
            width = bucket_for(page_buckets, cfg.pages_for(int(reach.max()) if reach.size else 1))
        tables = np.where(live[:, None], page_table[pick, :width], 0).astype(np.int32)
        return _DecodeBatch(rows, live, pick, np.where(live, positions[pick], 0).astype(np.int32),
                            tables, batched, slots)

    def _decode_result(self, tokens, logprobs, steps: int, sampling: SamplingParams,
                       batch: _DecodeBatch, emitted=None) -> DecodeTokens:
        tokens, logprobs = _local(tokens), jax.tree.map(_local, logprobs)
        tokens.copy_to_host_async()
        if emitted is not None:
            emitted = _local(emitted)
            emitted.copy_to_host_async()
        if np.asarray(sampling.logprobs)[batch.slots].any():
            _copy_to_host(logprobs)
        return DecodeTokens(tokens, steps, logprobs, emitted)

    def _decode_plan(self, lengths: np.ndarray) -> tuple[bool, int]:
        """The cheaper decode program for these live lengths (whether the batched one), and its
        page-table width.

        The batched program reads every slot (active or not) up to the longest one's bucket;
        the length-following one reads each slot only up to its own length but pays a loop per
        slot. Up to BATCHED_DECODE_MAX_KV the padding is cheaper than the loops; beyond it,
        following lengths wins.
        """
        cfg = self.config
        longest = cfg.pages_for(int(lengths.max()) if lengths.size else 1)
        batched = cfg.batched_decode_page_buckets
        if batched and longest <= batched[-1]:
            return True, bucket_for(batched, longest)
        return False, bucket_for(cfg.decode_page_buckets, longest)

    def _check_role(self, phase: str) -> None:
        if self.config.role not in ("both", phase):
            raise ValueError(f"this engine runs {self.config.role} only; {phase} belongs to the "
                             f"other engine of the pair")

    # -- accounting ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.config.pool_pages

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the pool holds on this process's devices: under tensor parallelism with
        attention replicated, one copy per device. Fixed at allocation."""
        return self._kv_cache_bytes
