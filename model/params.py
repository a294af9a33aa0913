"""The one description of a model's parameters: every tensor's path, shape, logical axes and
checkpoint names, from which everything else that needs the tree is derived.

    specs = param_specs(config)          # every tensor, in Hugging Face checkpoint order
    param_specs(config, "int8")          # the same, with int8 matrices and their scales
    abstract_params(config)              # ShapeDtypeStructs: orbax restore targets, checks
    random_params(config, key)           # random weights for tests and benchmarks
    build_tree(specs, lambda s: ...)     # any tree of the same paths (shardings, loaders)

A `ParamSpec` carries
    path       keys into the params tree (what the Flax modules of `model.llama` name)
    shape      the tensor in the params tree: kernels are [in, out]
    axes       one logical axis name per dimension (below), which `model.sharding` maps onto
               mesh axes: the sharding rules are data, not code per tensor
    hf_name    the safetensors name (`checkpoints.hf`)
    gguf_name  the GGUF name (`checkpoints.gguf`)
    transpose  checkpoints store it [out, in] (HF `Linear` weights, GGUF rows)
    rope_heads llama.cpp permutes the rows of a llama GGUF's q/k weights per head for its
               adjacent-pair RoPE: the head count to undo it with (0: not permuted)
    init       how `random_params` draws it: "fan_in" (truncated normal / sqrt(fan in), as
               Flax's `Dense`), "embed" (Flax's `Embed` default), "ones", "zeros"
    dtype      None: the engine's compute dtype; "int8": weight-only int8 (`model.quant`)

Logical axes: VOCAB, EMBED (the residual stream), HEADS (query heads x head_dim, flattened),
KV_HEADS (KV heads x head_dim, flattened), FFN (the MLP's hidden dimension). The KV page pool's
axes are named in the same terms (`model.sharding.POOL_AXES`).

Weights "int8" (`model.quant`) store every matrix (the kernels and the embedding) as int8 with
a float scale per output channel beside it, `<name>_scale`: a kernel's columns, the embedding's
rows (which are the tied LM head's output channels). Checkpoints hold the float tree; the int8
tree is derived from it when the weights are loaded.

Adding a family's tensor (Qwen2's q/k/v biases and Qwen3's q/k norms are two) is one entry
here: the loaders, the converted-checkpoint checks, random weights and the shardings all follow. `model.llama`'s
modules must build the same tree; `tests/test_hf_and_store.py` checks they do.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from cadence.model.config import ModelConfig

VOCAB, EMBED, HEADS, KV_HEADS, FFN = "vocab", "embed", "heads", "kv_heads", "ffn"
INITS = ("fan_in", "embed", "ones", "zeros")
WEIGHTS = ("float", "int8")  # how the matrices are stored
MATRICES = ("kernel", "embedding")  # the leaves int8 weights quantize


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf_name: str
    gguf_name: str
    transpose: bool = False
    rope_heads: int = 0
    init: str = "fan_in"
    dtype: str | None = None

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"{self.key}: {len(self.axes)} axis names for a {len(self.shape)}-d tensor")
        if self.init not in INITS:
            raise ValueError(f"{self.key}: init must be one of {INITS}, got {self.init!r}")

    @property
    def key(self) -> str:
        return "/".join(self.path)

    @property
    def channel_axis(self) -> int:
        """A matrix's output channels: a kernel's columns, the embedding's rows."""
        return 0 if self.path[-1] == "embedding" else len(self.shape) - 1

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape checkpoints store: [out, in] for transposed kernels."""
        return self.shape[::-1] if self.transpose else self.shape


def param_specs(config: ModelConfig, weights: str = "float") -> list[ParamSpec]:
    """Every tensor of `config`'s params, in Hugging Face checkpoint order; with int8 `weights`,
    each matrix int8 and followed by its scales (which no checkpoint holds)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    specs = _float_specs(config)
    if weights == "float":
        return specs
    out = []
    for s in specs:
        if s.path[-1] not in MATRICES:
            out.append(s)
            continue
        axis = s.channel_axis
        out.append(dataclasses.replace(s, dtype="int8"))
        out.append(ParamSpec(s.path[:-1] + (s.path[-1] + "_scale",), (s.shape[axis],), (s.axes[axis],),
                             hf_name="", gguf_name="", init="ones"))
    return out


def _float_specs(config: ModelConfig) -> list[ParamSpec]:
    c = config
    d, f, v = c.hidden_size, c.ffn_size, c.vocab_size
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    specs = [ParamSpec(("embed", "embedding"), (v, d), (VOCAB, EMBED), "model.embed_tokens.weight",
                       "token_embd.weight", init="embed")]
    for i in range(c.num_layers):
        hf, gg, ours = f"model.layers.{i}.", f"blk.{i}.", f"layers_{i}"
        specs.append(ParamSpec((ours, "attn_norm", "scale"), (d,), (EMBED,),
                               hf + "input_layernorm.weight", gg + "attn_norm.weight", init="ones"))
        for proj, out, axis, heads in (("q", q_out, HEADS, c.num_heads),
                                       ("k", kv_out, KV_HEADS, c.num_kv_heads),
                                       ("v", kv_out, KV_HEADS, 0)):
            specs.append(ParamSpec((ours, "attn", proj, "kernel"), (d, out), (EMBED, axis),
                                   f"{hf}self_attn.{proj}_proj.weight", f"{gg}attn_{proj}.weight",
                                   transpose=True, rope_heads=heads))
            if c.attention_bias:
                specs.append(ParamSpec((ours, "attn", proj, "bias"), (out,), (axis,),
                                       f"{hf}self_attn.{proj}_proj.bias", f"{gg}attn_{proj}.bias",
                                       init="zeros"))
        specs.append(ParamSpec((ours, "attn", "o", "kernel"), (q_out, d), (HEADS, EMBED),
                               hf + "self_attn.o_proj.weight", gg + "attn_output.weight",
                               transpose=True))
        if c.qk_norm:  # one scale over head_dim, shared by every head: replicated
            for proj in "qk":
                specs.append(ParamSpec((ours, "attn", f"{proj}_norm", "scale"), (c.head_dim,), (None,),
                                       f"{hf}self_attn.{proj}_norm.weight",
                                       f"{gg}attn_{proj}_norm.weight", init="ones"))
        if c.post_norms:  # (Gemma's HF names: its post_attention_layernorm is this one)
            specs.append(ParamSpec((ours, "attn_post_norm", "scale"), (d,), (EMBED,),
                                   hf + "post_attention_layernorm.weight",
                                   gg + "post_attention_norm.weight", init="ones"))
        specs.append(ParamSpec((ours, "mlp_norm", "scale"), (d,), (EMBED,),
                               hf + ("pre_feedforward_layernorm.weight" if c.post_norms
                                     else "post_attention_layernorm.weight"),
                               gg + "ffn_norm.weight", init="ones"))
        for proj, shape, axes in (("gate", (d, f), (EMBED, FFN)), ("up", (d, f), (EMBED, FFN)),
                                  ("down", (f, d), (FFN, EMBED))):
            specs.append(ParamSpec((ours, "mlp", proj, "kernel"), shape, axes,
                                   f"{hf}mlp.{proj}_proj.weight", f"{gg}ffn_{proj}.weight",
                                   transpose=True))
        if c.post_norms:
            specs.append(ParamSpec((ours, "mlp_post_norm", "scale"), (d,), (EMBED,),
                                   hf + "post_feedforward_layernorm.weight",
                                   gg + "post_ffw_norm.weight", init="ones"))
    specs.append(ParamSpec(("final_norm", "scale"), (d,), (EMBED,), "model.norm.weight",
                           "output_norm.weight", init="ones"))
    if not c.tie_embeddings:
        specs.append(ParamSpec(("lm_head", "kernel"), (d, v), (EMBED, VOCAB), "lm_head.weight",
                               "output.weight", transpose=True))
    return specs


def build_tree(specs: Iterable[ParamSpec], leaf: Callable[[ParamSpec], Any]) -> dict[str, Any]:
    """The nested dict with `leaf(spec)` at each spec's path."""
    return nest((spec.path, leaf(spec)) for spec in specs)


def nest(leaves: Iterable[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """The nested dict with each leaf at its path."""
    tree: dict[str, Any] = {}
    for path, leaf in leaves:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def abstract_params(config: ModelConfig, dtype: jnp.dtype = jnp.float32,
                    shardings: dict[str, Any] | None = None, weights: str = "float") -> dict[str, Any]:
    """Shapes and dtypes of the parameter tree, without allocating it; with `shardings` (a tree
    of the same paths), each leaf carries its sharding, as orbax's restore target wants."""
    return build_tree(param_specs(config, weights), lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype or dtype, sharding=None if shardings is None else get(shardings, s.path)))


def weights_of(params: dict[str, Any]) -> str:
    """Which WEIGHTS a params tree holds."""
    return "int8" if get(params, ("embed", "embedding")).dtype == jnp.int8 else "float"


def cast(array, dtype: jnp.dtype):
    """A leaf in the dtype the engine computes in; integer leaves (int8 weights, the CPU
    kernels' uint8 records) stay as they are."""
    return array if jnp.issubdtype(array.dtype, jnp.integer) else array.astype(dtype)


def cast_bytes(params: dict[str, Any], dtype: jnp.dtype) -> int:
    """The bytes `params` take once every leaf is `cast` to `dtype`."""
    itemsize = jnp.dtype(dtype).itemsize
    return sum(a.size * (1 if a.dtype == jnp.int8 else itemsize) for a in jax.tree.leaves(params))


_INITIALIZERS = {
    "fan_in": nn.initializers.lecun_normal(),
    "embed": nn.linear.default_embed_init,
    "ones": nn.initializers.ones,
    "zeros": nn.initializers.zeros,
}


def random_params(config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict[str, Any]:
    """Random weights with the model's exact tree, drawn as Flax's own initializers would
    (one key per tensor, folded in from its position in the spec), on the default device.

    Each tensor is its own small program, compiled once per (initializer, shape, dtype) and
    shared by every layer: one program for the whole tree costs a compile per tensor, which on
    a GPU took over a minute for SmolLM2's 30 layers and Llama-3-8B's 32 (the first GPU run,
    bench/results/gpu-2026-12-04-b/). Call it as it is, not under `jax.jit`."""
    specs = param_specs(config)
    index = {s.path: i for i, s in enumerate(specs)}
    return build_tree(specs, lambda s: _random_tensor(key, index[s.path], init=s.init,
                                                      shape=s.shape, dtype=jnp.dtype(dtype)))


@functools.partial(jax.jit, static_argnames=("init", "shape", "dtype"))
def _random_tensor(key: jax.Array, index: jax.Array, *, init: str, shape: tuple[int, ...],
                   dtype: jnp.dtype) -> jax.Array:
    return _INITIALIZERS[init](jax.random.fold_in(key, index), shape, jnp.float32).astype(dtype)
