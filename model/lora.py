"""LoRA adapters served beside the base model (vLLM's multi-LoRA, llama-server's --lora): every
loaded adapter's low-rank matrices in one bank inside the params, and the correction each
projection adds for the rows that use them.

    adapter = LoraAdapter("sql", rank=8, weights={(layer, "q"): (a, b), ...})
    params = with_bank(params, config, [adapter, ...], slots=4, rank=16)  # the bank's leaves
    scales = np.zeros((rows, slots)); scales[row, i] = 1.0     # row `row` uses adapter i
    logits, cache = forward(params, ..., adapters=scales)      # `model.llama`
    merged = merged_params(params, config, [(adapter, 1.0)])   # the reference's weights

An adapter changes a projection y = x W into y = x W + scale * (x a) b, with a [in, r] and b
[r, out] (PEFT's lora_A and lora_B transposed, its alpha / r folded into b). The bank holds, per
layer and projection, every adapter's a side by side, A [in, slots * rank], and its b stacked,
B [slots * rank, out], an adapter of lower rank padded with zeros, one that leaves the
projection alone all zeros. A row's scales [slots] (each adapter's weight for that row: 1 for
the adapter a request named, llama-server's per-request scales, 0 for the rest) are repeated
over the rank, so for every row of a batch, whatever adapters they mix,

    y = x W + ((x A) * s) B

two dense matmuls of width slots * rank per projection, and no program per adapter: the bank
is an argument of fixed shape, so loading an adapter into a slot compiles nothing, and a batch
of rows on different adapters runs as one. Projections no adapter touches have no bank entry
and cost nothing. The bank sits in the tree where its projections' modules are (`layers_i/attn/
lora/q/a`, with the layers stacked `layers/attn/lora/q/a` [layers, in, slots * rank], which the
layer loop indexes as it indexes a layer's norms).

The projections an adapter may change are a layer's q, k, v, o, gate, up and down (PEFT's
q_proj ... down_proj): not the embedding or the LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import control, cpu_kernels, layer_loop
from cadence.model.block_layout import block
from cadence.model.config import ModelConfig

ATTENTION = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")
PROJECTIONS = ATTENTION + MLP


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """A projection's kernel, [in, out]."""
    d, f = config.hidden_size, config.ffn_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}[proj]


def _module(proj: str) -> str:
    return "attn" if proj in ATTENTION else "mlp"


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter's matrices: {(layer, projection): (a [in, r], b [r, out])}, float32, its
    scaling (alpha / r) already in b, in the base model's layout (q and k in the rotate-half
    RoPE layout of `model.params`). `rank`: the highest r of its matrices (PEFT's rank_pattern
    gives some projections a rank of their own)."""

    name: str
    rank: int
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    def check(self, config: ModelConfig) -> None:
        """ValueError unless every matrix fits `config`'s projection and the rank."""
        if self.rank < 1:
            raise ValueError(f"adapter {self.name!r}: rank must be >= 1, got {self.rank}")
        for (layer, proj), (a, b) in self.weights.items():
            if not 0 <= layer < config.num_layers or proj not in PROJECTIONS:
                raise ValueError(f"adapter {self.name!r}: no projection {proj!r} in layer {layer} of "
                                 f"{config.name} ({config.num_layers} layers, {', '.join(PROJECTIONS)})")
            n_in, n_out = projection_shape(config, proj)
            r = a.shape[-1]
            if a.shape != (n_in, r) or b.shape != (r, n_out) or not 1 <= r <= self.rank:
                raise ValueError(f"adapter {self.name!r}: layer {layer}'s {proj} is {list(a.shape)} x "
                                 f"{list(b.shape)}; {config.name} needs [{n_in}, r] x [r, {n_out}], "
                                 f"r <= the adapter's rank {self.rank}")

    @property
    def projections(self) -> set[str]:
        return {proj for _, proj in self.weights}


def bank_arrays(config: ModelConfig, adapters: Sequence[LoraAdapter | None], slots: int, rank: int,
                projections: Sequence[str] | None = None) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """Per (layer, projection) of `projections` (default: those any adapter changes): (A [in,
    slots * rank], B [slots * rank, out]) float32, adapter i in slot i (None: an empty slot)."""
    if len(adapters) > slots:
        raise ValueError(f"{len(adapters)} adapters for a bank of {slots} slots")
    changed = {proj for adapter in adapters if adapter is not None for proj in adapter.projections}
    used = sorted(changed if projections is None else projections, key=PROJECTIONS.index)
    for adapter in filter(None, adapters):
        adapter.check(config)
        if adapter.rank > rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}; the bank holds "
                             f"rank {rank} at most (raise the maximum LoRA rank)")
        if not adapter.projections <= set(used):
            raise ValueError(f"adapter {adapter.name!r} changes {', '.join(sorted(adapter.projections - set(used)))}, "
                             f"which the bank does not hold ({', '.join(used)})")
    bank = {}
    for layer in range(config.num_layers):
        for proj in used:
            n_in, n_out = projection_shape(config, proj)
            a = np.zeros((n_in, slots * rank), np.float32)
            b = np.zeros((slots * rank, n_out), np.float32)
            for i, adapter in enumerate(adapters):
                if adapter is not None and (layer, proj) in adapter.weights:
                    a_i, b_i = adapter.weights[(layer, proj)]
                    a[:, i * rank: i * rank + a_i.shape[1]] = a_i
                    b[i * rank: i * rank + a_i.shape[1]] = b_i
            bank[(layer, proj)] = (a, b)
    return bank


def abstract_bank(config: ModelConfig, slots: int, rank: int, dtype
                  ) -> dict[tuple[int, str], tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """`bank_arrays`' shapes for every projection (a bank with slots to fill), as
    `jax.ShapeDtypeStruct`s of `dtype`: what lowering a program from shapes alone takes."""
    out = {}
    for layer in range(config.num_layers):
        for proj in PROJECTIONS:
            n_in, n_out = projection_shape(config, proj)
            out[(layer, proj)] = (jax.ShapeDtypeStruct((n_in, slots * rank), dtype),
                                  jax.ShapeDtypeStruct((slots * rank, n_out), dtype))
    return out


def with_bank(params: dict[str, Any], bank: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]],
              num_layers: int, place: Callable[[Any], Any] = lambda a: a,
              blocked: bool = False) -> dict[str, Any]:
    """`params` with the bank's leaves added (each array through `place`: onto a device)
    where the model reads them: per layer (`layers_i`), or stacked over layers where the tree's
    layers are (`layers`, `model.layer_loop`). `blocked`: in the CPU kernels' layout (a decode
    tree's, `model.cpu_kernels`), `a_blocked` and `b_blocked`; stacked layers (which only the
    kernels run) as `cpu_kernels.Stacked`, read at the loop's layer in place. Else `a` and `b`.
    The caller's tree is not changed."""
    names = ("a_blocked", "b_blocked") if blocked else ("a", "b")
    params = dict(params)
    if "layers" in params:  # stacked: one Stacked per projection's a and b, over every layer
        if not blocked:
            raise ValueError("stacked layers are the CPU kernels' (a decode tree): their bank is blocked")
        layers = dict(params["layers"])
        for proj in sorted({p for _, p in bank}, key=PROJECTIONS.index):
            pair = [jax.tree.map(place, layer_loop.stack_matrices([block(bank[(i, proj)][j])
                                                                   for i in range(num_layers)]))
                    for j in (0, 1)]
            _put(layers, (_module(proj), "lora", proj), dict(zip(names, pair)))
        params["layers"] = layers
        return params
    for (layer, proj), pair in bank.items():
        name = f"layers_{layer}"
        params[name] = dict(params[name])
        _put(params[name], (_module(proj), "lora", proj),
             dict(zip(names, [place(block(m) if blocked else m) for m in pair])))
    return params


def _put(tree: dict[str, Any], path: tuple[str, ...], leaves: dict[str, Any]) -> None:
    """tree[path] = leaves, copying the dicts on the way (the caller's tree is not changed)."""
    node = tree
    for key in path[:-1]:
        node[key] = dict(node.get(key, {}))
        node = node[key]
    node[path[-1]] = leaves


def plus(y: jax.Array, module, proj: str, x: jax.Array, scales: jax.Array | None) -> jax.Array:
    """y [rows, t, out] (projection `proj` of `module`, a `model.llama` Attention or MLP, over
    x [rows, t, in]) with the adapters' correction ((x A) * s) B added for each row's `scales`
    [rows, slots]: y as it is where the bank has no entry for it or there are no scales. On the
    CPU a batch whose rows use no adapter skips the correction (`control.when`); the CPU
    kernels' tree reads the bank with the kernels."""
    if scales is None or not module.has_variable("params", "lora"):
        return y
    bank = module.get_variable("params", "lora")
    if proj not in bank:
        return y
    node, n_out = bank[proj], y.shape[-1]
    if "a_blocked" in node:
        a, b = node["a_blocked"], node["b_blocked"]
        width = cpu_kernels.blocked_k(b)
        matmul = cpu_kernels.matmul
    else:
        a, b = node["a"].astype(module.dtype), node["b"].astype(module.dtype)
        width = a.shape[-1]
        matmul = lambda v, m, _: jnp.dot(v, m)  # noqa: E731
    rank = width // scales.shape[-1]

    def correction(x):
        s = jnp.repeat(scales.astype(module.dtype), rank, axis=-1)[:, None, :]  # [rows, 1, slots * rank]
        return matmul(matmul(x.astype(module.dtype), a, width) * s, b, n_out).astype(y.dtype)

    used = jnp.any(scales != 0)
    return y + control.when(used, correction, lambda x: jnp.zeros_like(y), x)


def merged_params(params: dict[str, Any], config: ModelConfig,
                  adapters: Sequence[tuple[LoraAdapter, float]]) -> dict[str, Any]:
    """A float tree (`model.params`' unrolled layout) with `adapters` merged into its kernels,
    each at its scale: W + sum(scale * a @ b), in float64 then float32. The reference the
    bank's path is tested against."""
    out = jax.tree.map(np.asarray, params)
    for adapter, scale in adapters:
        adapter.check(config)
        for (layer, proj), (a, b) in adapter.weights.items():
            node = out[f"layers_{layer}"][_module(proj)][proj]
            node["kernel"] = (node["kernel"].astype(np.float64)
                              + scale * (a.astype(np.float64) @ b.astype(np.float64))).astype(np.float32)
    return out
