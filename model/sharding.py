"""Tensor parallelism: how the parameters and the KV page pool lie over a mesh of devices.

    tp = TensorParallel.plan(config, devices)   # the rules for this model on these devices
    tp.compute_config                           # the config the programs run (KV heads repeated)
    params = tp.place(params, dtype)            # every device gets its shards
    tp.storage_shardings()                      # orbax restore targets for a converted checkpoint
    tp.pool_sharding                            # each layer of the KV page pool

One mesh axis, `AXIS`, over the devices. The sharding rules are data: a map from the logical
axis names of `model.params` (and the pool's, `POOL_AXES`) to the mesh axis or None, decided once
per model from its shape (Megatron-style, as vLLM and jax-llm-examples lay a Llama out):
- query heads and KV heads (q/k/v column-split, o row-split, the pool split by KV head), when
  both divide over the devices. With fewer KV heads than devices (but a whole number of
  devices per KV head), each KV head is computed and stored on `kv_repeat` devices: the k/v
  weights are repeated head by head at placement, so every device holds exactly the KV head
  its query heads read. Otherwise attention is replicated, and the reason is in `notes`.
- the MLP's hidden dimension (gate/up column-split, down row-split), when it divides.
- the vocabulary (embedding rows, the LM head's columns), when it divides.
- the residual stream (EMBED) is never split.
XLA's SPMD partitioner follows these shardings through every program and inserts the
collectives (an all-reduce after o and down, an all-gather of the logits); attention, whose
loops and Pallas kernels it cannot partition, runs per device under `shard_map` (`per_head`).

Non-goals: pipeline or sequence parallelism, a data-parallel axis, non-dividing splits (XLA
would pad; cadence replicates instead and says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cadence.model.config import ModelConfig
from cadence.model.params import (
    EMBED, FFN, HEADS, KV_HEADS, VOCAB, ParamSpec, build_tree, cast, get, param_specs, weights_of,
)

AXIS = "tp"
POOL_AXES = (KV_HEADS, None, None, None)  # a pool layer [kv_heads, pages, page_size, head_dim]
HANDLE_AXES = (None, KV_HEADS, None, None, None)  # a KV handle [layers, kv_heads, P, ps, hd]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    config: ModelConfig  # the model as its checkpoints store it
    mesh: Mesh
    rules: dict[str, str | None]  # logical axis -> mesh axis (None: replicated)
    kv_repeat: int  # devices that compute and store each KV head (1: the KV heads divide)
    notes: tuple[str, ...]  # what is replicated, and why

    @classmethod
    def plan(cls, config: ModelConfig, devices: Sequence[jax.Device]) -> TensorParallel:
        n = len(devices)
        if n < 1:
            raise ValueError("tensor parallelism needs at least one device")
        rules: dict[str, str | None] = dict.fromkeys((VOCAB, EMBED, HEADS, KV_HEADS, FFN))
        notes, repeat = [], 1
        heads, kv = config.num_heads, config.num_kv_heads
        if n > 1 and heads % n == 0 and (kv % n == 0 or n % kv == 0):
            rules[HEADS] = rules[KV_HEADS] = AXIS
            if kv % n:
                repeat = n // kv
                notes.append(f"{kv} KV heads over {n} devices: each KV head is computed and "
                             f"stored on {repeat} devices (the KV pool takes {repeat}x the "
                             "memory it would unsplit)")
        elif n > 1:
            notes.append(f"attention is replicated: {heads} query heads and {kv} KV heads do "
                         f"not split over {n} devices, so every device holds every head and "
                         "the whole KV pool")
        for axis, size, what in ((FFN, config.ffn_size, "the MLP's hidden size"),
                                 (VOCAB, config.vocab_size, "the vocabulary")):
            if n > 1 and size % n == 0:
                rules[axis] = AXIS
            elif n > 1:
                notes.append(f"{what} ({size}) does not split over {n} devices: replicated")
        mesh = Mesh(np.asarray(devices), (AXIS,))
        return cls(config=config, mesh=mesh, rules=rules, kv_repeat=repeat, notes=tuple(notes))

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def compute_config(self) -> ModelConfig:
        """The model the programs run: the same, but with each KV head `kv_repeat` times."""
        if self.kv_repeat == 1:
            return self.config
        return dataclasses.replace(self.config, num_kv_heads=self.config.num_kv_heads * self.kv_repeat)

    @property
    def heads_sharded(self) -> bool:
        return self.rules[HEADS] is not None

    @property
    def attention_mesh(self) -> Mesh | None:
        """The mesh attention runs per head over (`model.llama.forward`'s `mesh`), or None."""
        return self.mesh if self.heads_sharded else None

    def spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return PartitionSpec(*(None if a is None else self.rules[a] for a in axes))

    def sharding(self, axes: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def pool_sharding(self) -> NamedSharding:
        return self.sharding(POOL_AXES)

    @property
    def handle_sharding(self) -> NamedSharding:
        return self.sharding(HANDLE_AXES)

    def param_shardings(self) -> dict[str, Any]:
        """A tree of the compute params' shardings."""
        return build_tree(param_specs(self.compute_config), lambda s: self.sharding(s.axes))

    def storage_shardings(self) -> dict[str, Any]:
        """A tree of shardings for the params as stored (a restore target): what `place` then
        repeats (the k/v tensors, when `kv_repeat` > 1) is restored whole on every device."""
        return build_tree(param_specs(self.config), lambda s: (
            self.replicated if self._repeats(s) else self.sharding(s.axes)))

    def place(self, params: dict[str, Any], dtype: jnp.dtype) -> dict[str, Any]:
        """`params` (as stored: NumPy arrays, or jax arrays restored with `storage_shardings`)
        as the programs take them: k/v heads repeated where planned, cast to `dtype` (int8
        weights stay int8), and each device holding only its shards."""
        def leaf(spec: ParamSpec) -> jax.Array:
            array = get(params, spec.path)
            if self._repeats(spec):
                array = _repeat_heads(array, spec.axes.index(KV_HEADS), self.config.num_kv_heads,
                                      self.kv_repeat)
            return cast(jax.device_put(array, self.sharding(spec.axes)), dtype)

        return build_tree(param_specs(self.config, weights_of(params)), leaf)

    def repeat_kv(self, array, axis: int):
        """A k/v projection's `axis` of KV heads repeated as `place` repeats the weights' (a LoRA
        adapter's b, `model.lora`)."""
        if self.kv_repeat == 1:
            return array
        return _repeat_heads(array, axis, self.config.num_kv_heads, self.kv_repeat)

    def _repeats(self, spec: ParamSpec) -> bool:
        return self.kv_repeat > 1 and KV_HEADS in spec.axes

    def describe(self) -> str:
        split = ", ".join(a for a, m in self.rules.items() if m is not None) or "nothing"
        notes = "".join(f"; {n}" for n in self.notes)
        return f"tensor parallel over {self.size} devices: split {split}{notes}"


def _repeat_heads(array, axis: int, heads: int, repeat: int):
    """[..., heads * d, ...] -> [..., heads * repeat * d, ...], each head `repeat` times in a row
    (so query head h of the grouped attention still reads KV head h // group)."""
    xp = np if isinstance(array, np.ndarray) else jnp
    shape = array.shape
    split = xp.reshape(array, shape[:axis] + (heads, shape[axis] // heads) + shape[axis + 1:])
    return xp.reshape(xp.repeat(split, repeat, axis=axis),
                      shape[:axis] + (shape[axis] * repeat,) + shape[axis + 1:])


def per_head(attend: Callable, mesh: Mesh) -> Callable:
    """`attend(q, k, v, k_pages, v_pages, page_table, positions, lengths, *window)` run on each
    device over its own heads: q, k, v [rows, t, heads, d] and the pool layers split by head, the
    page table, positions, lengths (and a sliding window) whole on every device. Attention needs
    nothing from another device's heads, so no collective runs inside."""
    heads, pool, whole = PartitionSpec(None, None, AXIS), PartitionSpec(AXIS), PartitionSpec()

    def run(*args):
        specs = (heads, heads, heads, pool, pool) + (whole,) * (len(args) - 5)
        return jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=(heads, pool, pool),
                             check_vma=False)(*args)

    return run
