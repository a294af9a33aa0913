"""An engine's configuration and the shapes that follow from it (host side, no JAX).

    config = EngineConfig(num_slots=8, max_seq_len=2048, prefill_chunk=256)
    config.prefill_buckets, config.decode_batch_buckets, config.page_buckets   # compiled shapes

`EngineConfig` fixes everything an `engine.engine.Engine` compiles: how many sequences are in
flight, the longest sequence, the prefill chunk and packing, the KV pool's page size and pages,
the attention and decode matmul kernels, the engine's role in a disaggregated pair. Its
properties are the shape buckets the programs compile once each (`ladder`), which the scheduler
reads too (`engine.api`), so this module imports NumPy only. `GROUPS` and `WARMUPS` name the
groups of programs warm-up compiles (`Engine.program_groups`), and `fixed_page_tables` gives
benchmarks and tests a page table without the scheduler's allocator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes  # noqa: F401 (NumPy reads "bfloat16" once it is imported)
import numpy as np

from cadence.engine.packing import bucket_for
from cadence.model.arith import cdiv


# Measured with SmolLM2-135M on the 2-core CPU: batched decode beat the per-slot loops at 128
# live tokens (8 slots 46-50 vs 64 ms/step; 1 slot 25 vs 31; 4 of 8 slots ~45 vs 60) and lost
# from ~300 on (8 slots: 73 vs 60 ms at 300, 117 vs 81 ms at 1000), so it serves up to here.
BATCHED_DECODE_MAX_KV = 256


def ladder(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` below `high`, then `high` itself."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (high,)


# The measured default page sizes (tokens per page): on the 2-core CPU the per-page decode loop
# costs a step per page, so small pages are slow (16-token pages up to 2x at 1k tokens, 64 about
# 1.2x, 128 at or below the contiguous loop;
# `bench/results/paged-attention-cpu/paged_attention.txt`).
DEFAULT_PAGE_SIZE = 64
# What the CPU kernels' grouped matmuls take as activations: `model.cpu_kernels.ACTIVATIONS`,
# named here too so that this module stays free of JAX.
CPU_ACTIVATIONS = ("float32", "int8")

ROLES = ("both", "prefill", "decode")
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
DECODE_MATMULS = ("xla", "cpu")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8  # most sequences in flight
    max_seq_len: int = 2048  # longest sequence, prompt + output
    prefill_chunk: int = 256  # the longest chunk of one prompt; longer prompts go in chunks
    # The most tokens one packed prefill program carries, padding included (None:
    # prefill_chunk): every chunk of an iteration, up to this, runs in one program.
    prefill_tokens: int | None = None
    min_prefill_bucket: int = 16
    min_kv_bucket: int = 256  # tokens: the narrowest page-table bucket covers this many
    attention: str = "xla"
    dtype: str = "float32"  # compute dtype: float32 on CPU, bfloat16 on GPU
    # The KV pool's dtype (None: dtype). 16-bit pages on the CPU halve the pool, 8-bit float
    # ones quarter it; every reader widens them as it reads (the CPU kernel as it loads them).
    kv_dtype: str | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None  # the pool; None: every slot can hold max_seq_len at once
    # Most chunks one packed prefill program carries (None: num_slots). 1 runs every chunk as
    # a program of its own, as cadence did before packing: the baseline of the packing bench.
    max_prefill_chunks: int | None = None
    # Which programs this engine runs: "both" (colocated serving), or one phase of a
    # disaggregated pair: "prefill" (prefill, and extract to hand KV on) or "decode" (decode,
    # and insert to take it); warm-up compiles only the role's programs.
    role: str = "both"
    # The most decode steps one dispatch runs (`decode(..., steps=k)`, k <= this); the same
    # program runs any k, so this costs no compile.
    decode_steps: int = 1
    # The most top_logprobs a request may ask for: both programs compute this many
    # alternatives per token (only in steps where some row asks for logprobs), so the number
    # a request asks for costs no compile.
    max_logprobs: int = 20
    # Decode's matmuls: "xla", or "cpu": the CPU kernel (`model.cpu_kernels`) over a copy of
    # the weights in its blocked layout, made when the engine places them (float32 or int8
    # weights, or the checkpoint's block-quantized matrices as they are: `Engine(packed=)`;
    # float32 compute, one device).
    decode_matmul: str = "xla"
    # What the CPU kernels' grouped (GGUF-block) matmuls take as activations: "float32" (the
    # checkpoint's own weights against x as it is, the reference's numbers summed in another
    # order) or "int8" (x quantized per 32 k-rows, integer dot products, llama.cpp's numerics:
    # faster decode, not the reference's numbers). `cpu_kernels.activations`.
    cpu_activations: str = "float32"
    # Where the CPU kernels run the whole model (decode_matmul and attention "cpu"), its
    # layers run as one loop over weights and a pool stacked over layers (`model.layer_loop`):
    # each program compiles and holds one layer's kernels rather than every layer's. False
    # unrolls them, as every other path runs (the reference the loop is tested against).
    layer_loop: bool = True
    # Also compile the two halves of a decode step (`decode_forward`, `decode_sample`) that a
    # grammar-constrained row needs: its bitmask is filled on the host between them.
    structured_output: bool = False
    # Speculative decoding: the most draft tokens a verify step scores per row after its last
    # token (0: no verify program), and the most rows it runs (its batch buckets; above it the
    # scheduler decodes plainly, where a step costs its compute rather than its weight read).
    speculative_tokens: int = 0
    speculative_batch: int = 4
    # LoRA adapters (`model.lora`): the bank's slots (how many adapters the engine holds at
    # once; 0: none, the programs as without) and the highest rank it holds. The bank is an
    # argument of fixed shape: what a slot holds, and which rows use it, compile nothing.
    lora_slots: int = 0
    lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.prefill_chunk < 1 or self.prefill_chunk > self.max_seq_len:
            raise ValueError(
                f"prefill_chunk must be in [1, max_seq_len={self.max_seq_len}], got {self.prefill_chunk}"
            )
        if self.decode_matmul not in DECODE_MATMULS:
            raise ValueError(f"decode_matmul must be one of {DECODE_MATMULS}, got {self.decode_matmul!r}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations must be one of {CPU_ACTIVATIONS}, got "
                             f"{self.cpu_activations!r}")
        if self.cpu_activations != "float32" and self.decode_matmul != "cpu":
            raise ValueError(f"cpu_activations={self.cpu_activations!r} is the CPU kernels' "
                             f"(decode_matmul='cpu'), not {self.decode_matmul!r}'s")
        if "cpu" in (self.attention, self.decode_matmul) and np.dtype(self.dtype) != np.float32:
            # The kernels read float32 pools and activations: another dtype would be cast whole
            # on every layer of every step.
            raise ValueError(f"the CPU kernels (attention or decode_matmul 'cpu') compute in "
                             f"float32; dtype is {self.dtype}")
        if np.dtype(self.pool_dtype).name not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        narrow = np.dtype(self.pool_dtype).itemsize == 1  # an 8-bit float pool
        if (self.attention == "mosaic" or (self.attention == "pallas" and not narrow)) and (
                np.dtype(self.pool_dtype) != np.dtype(self.dtype)):
            raise ValueError(f"the {self.attention} kernels read a pool of the compute dtype "
                             f"({self.dtype})" + (" or an 8-bit float" if self.attention == "pallas" else "")
                             + f"; kv_dtype is {self.kv_dtype}")
        if self.attention == "mosaic" and np.dtype(self.dtype).itemsize != 2:
            raise ValueError(f"the Mosaic GPU kernels compute in bfloat16 or float16; dtype is "
                             f"{self.dtype}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.speculative_tokens < 0 or self.speculative_batch < 1:
            raise ValueError(f"speculative_tokens must be >= 0 and speculative_batch >= 1, got "
                             f"{self.speculative_tokens} and {self.speculative_batch}")
        if self.lora_slots < 0 or self.lora_rank < 0 or (self.lora_slots > 0) != (self.lora_rank > 0):
            raise ValueError(f"lora_slots and lora_rank are both 0 (no adapters) or both >= 1, got "
                             f"{self.lora_slots} and {self.lora_rank}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.prefill_tokens is not None and self.prefill_tokens < self.prefill_chunk:
            raise ValueError(f"prefill_tokens ({self.prefill_tokens}) must hold one prefill_chunk "
                             f"({self.prefill_chunk})")
        if self.max_prefill_chunks is not None and self.max_prefill_chunks < 1:
            raise ValueError(f"max_prefill_chunks must be >= 1, got {self.max_prefill_chunks}")
        if self.num_pages is not None and self.num_pages < self.max_pages_per_seq:
            raise ValueError(
                f"a KV pool of {self.num_pages} pages x {self.page_size} tokens cannot hold one "
                f"sequence of max_seq_len={self.max_seq_len}; give it more memory or lower "
                "max_seq_len")

    @property
    def max_pages_per_seq(self) -> int:
        return cdiv(self.max_seq_len, self.page_size)

    @property
    def pool_dtype(self) -> str:
        """The KV pool's dtype: kv_dtype, or the compute dtype."""
        return self.kv_dtype or self.dtype

    @property
    def pool_pages(self) -> int:
        return self.num_slots * self.max_pages_per_seq if self.num_pages is None else self.num_pages

    @property
    def decode_batch_buckets(self) -> tuple[int, ...]:
        """Rows of the decode programs: powers of two below num_slots, then num_slots."""
        return ladder(1, self.num_slots)

    @property
    def chunks_per_program(self) -> int:
        return self.max_prefill_chunks or self.num_slots

    @property
    def pack_block(self) -> int:
        """Tokens per row of a packed prefill: every chunk starts on a multiple of it."""
        return min(self.min_prefill_bucket, self.prefill_chunk)

    @property
    def score_bucket(self) -> int:
        """Tokens of the largest scoring prefill program (`PrefillChunk.targets`): one chunk."""
        return bucket_for(self.prefill_buckets, cdiv(self.prefill_chunk, self.pack_block) * self.pack_block)

    @property
    def score_buckets(self) -> tuple[int, ...]:
        """Tokens of the scoring prefill programs: prefill buckets each at least 4x the one
        before, up to `score_bucket`. A scored chunk runs alone, so its program is sized to it
        (a short prompt's logits at 16 positions, not a whole chunk's), within 4x, in few
        programs."""
        buckets: list[int] = []
        for t in self.prefill_buckets:
            if t <= self.score_bucket and (not buckets or t >= 4 * buckets[-1]):
                buckets.append(t)
        if buckets[-1] != self.score_bucket:
            buckets.append(self.score_bucket)
        return tuple(buckets)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Tokens of the packed prefill programs: multiples of `pack_block` up to the first
        that holds `prefill_tokens`."""
        block = self.pack_block
        return ladder(block, cdiv(self.prefill_tokens or self.prefill_chunk, block) * block)

    def pages_for(self, tokens: int) -> int:
        return cdiv(tokens, self.page_size)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        """Page-table widths: powers of two from `min_kv_bucket` tokens' worth to the longest
        sequence's (prefill, and the batched decode program)."""
        low = min(self.pages_for(self.min_kv_bucket), self.max_pages_per_seq)
        return ladder(low, self.max_pages_per_seq)

    @property
    def prefill_page_buckets(self) -> tuple[int, ...]:
        """Widths of the packed prefill programs. "xla" and "pallas" attention walk each query
        tile's pages only up to its own positions, so the width costs nothing but int32s and
        one program per token bucket serves every length (a quarter of the compiles at 4096
        tokens); the reference gathers the whole table, so it keeps the ladder."""
        return self.page_buckets if self.attention == "reference" else (self.max_pages_per_seq,)

    @property
    def decode_page_buckets(self) -> tuple[int, ...]:
        """Widths of the length-following decode program ("xla", "pallas"): it stops at each
        slot's own length, so it takes the whole table: one program. The reference has none."""
        return () if self.attention == "reference" else (self.max_pages_per_seq,)

    @property
    def batched_decode_page_buckets(self) -> tuple[int, ...]:
        """Widths of the batched (einsum) decode program: the reference's only decode path,
        and "xla"'s choice for short contexts of similar lengths, where the per-slot loops of
        the length-following program cost more than the padding they save."""
        if self.attention == "reference":
            return self.page_buckets
        if self.attention == "xla":  # "cpu" and "pallas" follow lengths without loop steps
            most = self.pages_for(BATCHED_DECODE_MAX_KV)
            return tuple(p for p in self.page_buckets if p <= most)
        return ()


    @property
    def verify_batch_buckets(self) -> tuple[int, ...]:
        """Rows of the verify program (speculative decoding): powers of two up to
        speculative_batch (or num_slots, if fewer)."""
        return ladder(1, min(self.num_slots, self.speculative_batch))

    @property
    def verify_page_buckets(self) -> tuple[int, ...]:
        """Widths of the verify program: a row's 1 + k queries attend as a prefill chunk's do,
        so its widths are prefill's."""
        return self.prefill_page_buckets


def fixed_page_tables(config: EngineConfig, order: Sequence[int] | None = None) -> np.ndarray:
    """A page table [num_slots, max_pages_per_seq] giving every slot its own run of pages for
    its whole length, taken in `order` (default: 0, 1, 2, ...): the layout before paging, for
    benchmarks and tests that drive the engine without the scheduler's allocator. Needs a pool
    of at least num_slots x max_pages_per_seq pages (the default pool)."""
    count = config.num_slots * config.max_pages_per_seq
    if config.pool_pages < count:
        raise ValueError(f"fixed page tables need {count} pages; the pool has {config.pool_pages}")
    pages = np.arange(count) if order is None else np.asarray(order)[:count]
    return pages.reshape(config.num_slots, config.max_pages_per_seq).astype(np.int32)



# The groups of programs an engine compiles, in warm-up's order. Warm-up compiles every group
# of the engine's role ("all"), or only those every request runs ("needed": prefill and decode,
# the page copy on the engine that admits, verify where speculation is on, and moving KV in a
# disaggregated pair); the others compile on first use (`Engine.prepare`):
#   scoring     echo and prompt logprobs: the prefill that scores every position
#   pooling     embeddings: the prefill that samples nothing and sums each chunk's hidden states
#   structured  response formats and forced tool calls: a decode step split for the bitmask
#   transfer    moving KV between the engines of a disaggregated pair (extract, insert)
#   history     presence, frequency and repetition penalties: a slot's token history
#   copy        a cached prefix that ends inside a page (a partial match, or a later sequence
#               of a group, n > 1): its own copy of that page
#   speculative speculative decoding's verify program (with speculative_tokens > 0); where
#               warm-up left it out, the scheduler starts its compile at the first iteration
#               that could draft, and decodes plainly until it is ready
GROUPS = ("prefill", "scoring", "pooling", "decode", "structured", "transfer", "history", "copy", "speculative")
WARMUPS = ("all", "needed")
