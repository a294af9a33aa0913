"""Warm-up: the programs an engine compiles ahead of time, and compiling them several at once.

    programs = list_programs(...)               # [WarmProgram(group, name, fn, args), ...]
    compile_programs(programs, progress)        # each lowered here, compiled on a pool thread

`list_programs` gives every program of the groups asked for (`engine.config.GROUPS`), once per
shape bucket, over abstract device buffers (`spec`), in warm-up's order; `Engine.warm_programs`
is it for one engine. `Engine.warmup` and `Engine.prepare` (a group compiled on first use)
compile through `compile_programs`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from absl import logging

from cadence.engine import compile_counter
from cadence.engine.config import GROUPS, WARMUPS, EngineConfig
from cadence.engine.packing import empty_pack, row_chunks
from cadence.engine.programs import Programs, sampling_rows
from cadence.model.config import ModelConfig
from cadence.model.host_sampling import MAX_DRY_BREAKERS, SAMPLER_STATE, RequestSampling, all_allowed


@dataclasses.dataclass(frozen=True)
class WarmProgram:
    """One program warm-up compiles: the jitted `fn` over `args` (device buffers as
    `jax.ShapeDtypeStruct`s with their shardings, host arguments as the engine passes them)."""

    group: str
    name: str  # the program and its bucket, e.g. "decode[batch=8,pages=64]"
    fn: Callable
    args: tuple


def spec(x):
    """`x` as a compile argument: a device array as its shape, dtype and sharding."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type)
    return x


def compile_programs(programs: Sequence[WarmProgram],
                     progress: Callable[[int, int, str], None] | None = None,
                     workers: int | None = None) -> None:
    """Compiles `programs` ahead of time (`jit(...).lower(...).compile()`, which fills the
    jitted function's own cache, so its first call compiles nothing): each is traced and
    lowered on this thread, in order (that holds the GIL), and compiled on one of `workers`
    threads, which XLA's compiler runs without the GIL (default: one per two cores: on the
    2-core CPU, two at once compiled the default model's 30 programs no faster than one,
    `bench/results/startup-cpu`; with one, each is lowered and compiled on this thread).
    `progress(done, total, name)` after each (on the thread that compiled it)."""
    total, done, lock = len(programs), [0], threading.Lock()

    def finished(name: str, future: Future) -> None:
        if future.exception() is None and progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], total, name)

    workers = workers or max(1, (os.cpu_count() or 1) // 2)
    if workers == 1:  # one after another, on this thread
        for i, p in enumerate(programs, 1):
            p.fn.lower(*p.args).compile()
            if progress is not None:
                progress(i, total, p.name)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="cadence-compile") as pool:
        futures = []
        for p in programs:
            future = pool.submit(p.fn.lower(*p.args).compile)
            future.add_done_callback(functools.partial(finished, p.name))
            futures.append(future)
        for future in futures:
            future.result()


def list_programs(programs: Programs, cfg: EngineConfig, mc: ModelConfig, specs: tuple,
                  handle_sharding, groups: Collection[str]) -> list[WarmProgram]:
    """The programs of `groups` an engine of `cfg` runs (`programs`, for the model as computed,
    `mc`), in warm-up's order, over its device buffers as `specs` (`spec` of its params, the
    one tree every program reads, rope table, pool, next tokens and token history; a
    `KVHandle`'s pages go on `handle_sharding`): what `Engine.warmup` and `Engine.prepare`
    compile."""
    vocab, groups = mc.vocab_size, set(groups)
    params, rope, cache, last, history = specs
    i32 = np.int32(0)
    out: list[WarmProgram] = []

    def add(group, name, fn, *args):
        if group in groups:
            out.append(WarmProgram(group, name, fn, args))

    def rows(n):
        return sampling_rows([RequestSampling()] * n, cfg.lora_slots)

    # Packs mix sequences, so any token bucket can meet any page-table width; so can a
    # scored chunk's.
    shapes = [(t, w, "prefill") for t in cfg.prefill_buckets for w in cfg.prefill_page_buckets]
    shapes += [(t, w, "scoring") for t in cfg.score_buckets for w in cfg.prefill_page_buckets]
    for t, width, group in shapes:
        pack = empty_pack(t, width, cfg.pack_block, cfg.num_slots, cfg.chunks_per_program)
        n = len(pack.steps)
        scored = (np.full(t, -1, np.int32),) if group == "scoring" else ()
        add(group, f"{'prefill_scored' if scored else 'prefill'}[tokens={t},pages={width}]",
            programs.prefill_scored if scored else programs.prefill, params, rope, cache, last,
            history, pack.tokens, pack.positions, pack.lengths, pack.tables, pack.logit_index,
            row_chunks(pack), pack.steps, pack.write_slot, pack.sampling_slot, rows(n), all_allowed(n, vocab),
            *scored)
    for t, width in ((t, w) for t in cfg.prefill_buckets for w in cfg.prefill_page_buckets):
        pack = empty_pack(t, width, cfg.pack_block, cfg.num_slots, cfg.chunks_per_program)
        add("pooling", f"prefill_pooled[tokens={t},pages={width}]", programs.prefill_pooled, params,
            rope, cache, pack.tokens, pack.positions, pack.lengths, pack.tables, pack.logit_index,
            row_chunks(pack))
    decode = [("decode_batched", programs.decode_batched, programs.decode_forward_batched, w)
              for w in cfg.batched_decode_page_buckets]
    decode += [("decode", programs.decode, programs.decode_forward, w) for w in cfg.decode_page_buckets]
    for name, program, _, width in decode:
        for batch in cfg.decode_batch_buckets:
            add("decode", f"{name}[batch={batch},pages={width}]", program, params, rope,
                cache, last, history, np.full(batch, cfg.num_slots, np.int32),
                np.zeros(batch, np.int32), np.zeros((batch, width), np.int32), rows(batch),
                np.int32(1))
    if "structured" in groups:
        for batch in cfg.decode_batch_buckets:
            slots, zeros = np.full(batch, cfg.num_slots, np.int32), np.zeros(batch, np.int32)
            for name, _, forward_program, width in decode:
                add("structured", f"{name.replace('decode', 'decode_forward')}[batch={batch},"
                    f"pages={width}]", forward_program, params, rope, cache, last, slots,
                    zeros, np.zeros((batch, width), np.int32), rows(batch))
            logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32, sharding=last.sharding)
            add("structured", f"decode_sample[batch={batch}]", programs.decode_sample, logits,
                last, history, slots, zeros, rows(batch), all_allowed(batch, vocab))
    if "speculative" in groups:
        k = cfg.speculative_tokens
        for width in cfg.verify_page_buckets:
            for batch in cfg.verify_batch_buckets:
                add("speculative", f"verify[batch={batch},pages={width},k={k}]", programs.verify,
                    params, rope, cache, last, history, np.full(batch, cfg.num_slots, np.int32),
                    np.zeros(batch, np.int32), np.zeros((batch, width), np.int32), rows(batch),
                    np.zeros((batch, k), np.int32), np.zeros(batch, np.int32),
                    all_allowed((batch, k + 1), vocab))
    for width in cfg.page_buckets:  # a KVHandle's arrays: [layers, kv_heads, P, page_size, d]
        kv = jax.ShapeDtypeStruct((mc.num_layers, mc.num_kv_heads, width, cfg.page_size,
                                   mc.head_dim), cache.dtype, sharding=handle_sharding)
        add("transfer", f"extract[pages={width}]", programs.extract, cache, last,
            np.zeros(width, np.int32), i32)
        add("transfer", f"insert[pages={width}]", programs.insert, cache, last, kv, kv,
            np.zeros(width, np.int32), i32,
            jax.ShapeDtypeStruct((), jnp.int32, sharding=last.sharding))
    add("history", "history", programs.history, history, i32, np.zeros(cfg.max_seq_len, np.int32), i32,
        i32, np.zeros(MAX_DRY_BREAKERS, np.int32),
        np.zeros(cfg.max_seq_len, np.int32), np.zeros(SAMPLER_STATE, np.float32))
    add("history", "sampler", programs.sampler, history, i32)
    add("copy", "copy", programs.copy, cache, np.zeros(cfg.num_slots, np.int32),
        np.zeros(cfg.num_slots, np.int32))
    return out


class Compiling:
    """Warm-up and compiling on first use, for an `engine.engine.Engine` (its config, programs,
    `_lock`, and the `_compiler` thread it compiles groups on). Until `warmup` runs, every
    program compiles inline on its first call, as any jitted function does."""

    def program_groups(self, warmup: str = "all") -> tuple[str, ...]:
        """The groups of programs (`GROUPS`) this engine's role and configuration run; with
        warmup="needed", those every request needs (prefill and decode; on the engine that
        admits, the page copy that a cached prefix ending inside a page takes; speculative
        decoding's verify, where it is on; and moving KV for one engine of a disaggregated
        pair), which warm-up compiles: the rest compile on first use."""
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
        cfg = self.config
        groups = [g for g in GROUPS if not (
            (cfg.role == "decode" and g in ("prefill", "scoring", "pooling"))
            or (cfg.role == "prefill" and g in ("decode", "structured"))
            or (g == "structured" and not cfg.structured_output)
            or (g == "speculative" and (cfg.speculative_tokens == 0 or cfg.role == "prefill")))]
        if warmup == "needed":
            groups = [g for g in groups if g in ("prefill", "decode")
                      or (g == "copy" and cfg.role != "decode") or g == "speculative"
                      or (g == "transfer" and cfg.role != "both")]
        return tuple(groups)

    def warm_programs(self, groups: Sequence[str] | None = None) -> list[WarmProgram]:
        """The programs of `groups` (default: every group this engine runs), in warm-up's order,
        over abstract device buffers: what `warmup` and `prepare` compile (`list_programs`)."""
        return list_programs(self._programs, self.config, self.compute_config, self._specs,
                             self._handle_sharding,
                             self.program_groups() if groups is None else groups)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None,
               warmup: str = "all", workers: int | None = None,
               groups: Sequence[str] | None = None) -> None:
        """Compiles the programs of `program_groups(warmup)` ("all": every program this engine
        can run; "needed": those every request runs, the rest on first use), or of `groups`,
        `workers` at a time (`compile_programs`): each is traced and lowered here, one after
        another, and compiled on a pool thread. Nothing runs, so no device state changes.
        `progress(done, total, name)` follows each compile."""
        groups = self.program_groups(warmup) if groups is None else tuple(groups)
        programs = self.warm_programs(groups)
        compile_programs(programs, progress, workers)
        with self._lock:
            self._ready = set(groups)
        self._warm_compiles = compile_counter.count() - compile_counter.on_demand_count()
        self._warm_on_demand = compile_counter.on_demand_count()

    def ready(self, group: str) -> bool:
        """Whether `group`'s programs are compiled (or compile inline, on an engine never warmed
        up, as any jitted function does)."""
        return self._warm_compiles is None or group in self._ready or group not in self.program_groups()

    def prepare(self, groups: Sequence[str]) -> Future | None:
        """Starts compiling the programs of `groups` that are not compiled yet, on a thread of
        the engine's own, and returns at once: None when there is nothing to wait for, else a
        future done when all are compiled (its exception: why one failed). A group compiles
        once, whoever asks first; the others wait on the same future. The scheduler parks a
        request that needs one until it is done (`scheduler.scheduler`), so other requests
        never wait for it; a direct call (`_ensure`) waits."""
        missing = [g for g in groups if not self.ready(g)]
        if not missing:
            return None
        with self._lock:
            futures = []
            for group in missing:
                if group not in self._compiling:
                    programs = self.warm_programs([group])
                    self._compiling[group] = self._compiler.submit(self._compile_group, group, programs)
                futures.append(self._compiling[group])
        if len(futures) == 1:
            return futures[0]
        both: Future = Future()
        pending = [len(futures)]

        def one_done(f: Future) -> None:
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if f.exception() is not None and not both.done():
                both.set_exception(f.exception())
            elif last and not both.done():
                both.set_result(None)

        for f in futures:
            f.add_done_callback(one_done)
        return both

    def _compile_group(self, group: str, programs: list[WarmProgram]) -> None:
        start = time.monotonic()
        with compile_counter.on_demand():
            compile_programs(programs, workers=1)
        with self._lock:
            self._ready.add(group)
        logging.info("compiled %s on first use (%d programs, %.1f s)", group, len(programs),
                     time.monotonic() - start)

    def _ensure(self, group: str) -> None:
        """Before a program of `group` runs: compiled on demand if warm-up left it out."""
        future = self.prepare([group])
        if future is not None:
            future.result()

    @property
    def compilations_on_demand(self) -> int:
        """Compilations of programs warm-up left for their first use, since warm-up."""
        if self._warm_compiles is None:
            return 0
        return compile_counter.on_demand_count() - self._warm_on_demand

    @property
    def warmed_up(self) -> bool:
        return self._warm_compiles is not None

    @property
    def compilations_after_warmup(self) -> int:
        """Compilations since warm-up, those of programs compiled on first use excepted."""
        if self._warm_compiles is None:
            return 0
        return compile_counter.count() - compile_counter.on_demand_count() - self._warm_compiles
