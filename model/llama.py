"""The Llama-family decoder in Flax, as a pure function of (params, tokens, positions, KV pages).

    logits, cache = forward(params, tokens, positions, lengths, cache, page_table, config=...)

    tokens, positions  [rows, t] int32   a row is one sequence's chunk (t = 1 for decode)
    lengths            [rows] int32      valid tokens per row; the rest is bucket padding
    cache              `PagedKVCache`    the page pool, every sequence's KV
    page_table         [rows, pages] int32  each row's sequence's pages, in order; its width
                                         bounds what attention can read (the caller buckets it)
    logit_index        [n] int32 or None: the tokens whose logits to return, as flat indices
                                         into [rows * t] (row r's token i is r * t + i)
    rope_table         [2, n, head_dim / 2] or None: `rope_table(config, n)`, RoPE's cos and
                                         sin looked up for positions below n, else computed

Each layer writes the chunk's keys and values into the row's pages first, then attends over
them, so a whole prompt, a prefill chunk at any offset and a decode step are the same computation.
The engine jits this with fixed shapes and donates the cache; nothing in here is Python-side
state that varies per request.

The parameter tree is described once, in `model.params` (kernels are [in, out]; query/key
weights in the rotate-half RoPE layout); these modules build exactly that tree. Given int8
matrices (`model.quant`), `Linear` and `Embed` read them with their per-channel scales; given a
decode tree (`model.cpu_kernels.decode_params`: `kernel_blocked` for `kernel`, q/k/v and
gate/up fused into `qkv` and `gate_up`, and the tied LM head's `embedding_blocked`), they run
the CPU matmul kernel over it: the same modules, whatever the weights. A tree with a LoRA bank
(`model.lora`) and `forward`'s `adapters` (each row's scale per adapter) adds each adapter's
correction to the projections it changes.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import control, cpu_kernels, layer_loop, lora, paged_kv, sharding
from cadence.model.config import ModelConfig
from cadence.model.paged_attention import get_paged_attention, writes_in_place
from cadence.model.paged_kv import PagedKVCache


def rope_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama-3 or YaRN scaling and per-frequency
    factors (`rope_freq_factors`, each frequency divided by its own: linear scaling is one
    factor for all) when configured. `local`: the sliding-window layers' own (Gemma 3's
    `rope_local_theta`), which nothing scales."""
    half = config.head_dim // 2
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2 / config.head_dim))
    if local:
        return inv_freq.astype(np.float32)
    if config.rope_scaling is not None:
        scaled = _yarn_scaled if config.rope_scaling.rope_type == "yarn" else _llama3_scaled
        inv_freq = scaled(inv_freq, config)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float64)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    s = config.rope_scaling
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, blended)
    return np.where(wavelen < high_wavelen, inv_freq, scaled)


def _yarn_scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """YaRN's blend: pair i's frequency divided by `factor` in the share `ramp[i]`, the ramp
    rising from 0 at the pair that turns `beta_fast` times over the original context (rounded
    down) to 1 at the one turning `beta_slow` times (rounded up), as transformers and llama.cpp
    place it."""
    s, dim = config.rope_scaling, config.head_dim

    def pair_turning(turns: float) -> float:  # solves original / wavelength(pair) = turns
        return dim * math.log(s.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low = max(math.floor(pair_turning(s.beta_fast)), 0)
    high = min(math.ceil(pair_turning(s.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(len(inv_freq)) - low) / max(high - low, 0.001), 0.0, 1.0)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def rope_tables(positions: jax.Array, config: ModelConfig, local: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's angles, [*positions.shape, head_dim / 2], float32 (times
    YaRN's attention factor where the model scales so); `local`: the sliding layers' own."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config, local)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    magnitude = 1.0 if config.rope_scaling is None or local else config.rope_scaling.magnitude
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    return cos, sin


def rope_table(config: ModelConfig, length: int) -> jax.Array:
    """`rope_tables` of positions 0..length-1, stacked: [2, length, head_dim / 2], and the
    sliding layers' own after them ([4, ...]) where they have a base of their own. An engine
    makes it once and its programs look positions up in it (`forward`'s `rope_table`): computed
    inside a program, XLA fuses the cos and sin into each of the 2 * layers projections that
    use them and evaluates them anew in each, per head (on XLA:CPU, over 50 ms of trigonometry
    per 512-token prefill chunk of SmolLM2-135M, ~2.5 ms per decode step at 8 rows)."""
    positions = jnp.arange(length)
    local = rope_tables(positions, config, True) if config.rope_local_theta is not None else ()
    return jnp.stack([*rope_tables(positions, config), *local])


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [rows, t, heads, head_dim]; cos, sin [rows, t, 1, head_dim / 2]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Linear(nn.Module):
    """`nn.Dense`, over a float kernel [in, out] or an int8 one with `kernel_scale` [out]: the
    matmul reads the kernel converted to `dtype` and scales each output channel."""

    features: int
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel_blocked"):  # a decode tree (`model.cpu_kernels`)
            scale = (self.get_variable("params", "kernel_scale")
                     if self.has_variable("params", "kernel_scale") else None)
            y = cpu_kernels.matmul(x, self.get_variable("params", "kernel_blocked"), self.features,
                                   scale).astype(self.dtype)
            return y + self._bias() if self.use_bias else y
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                            jnp.float32)
        x = x.astype(self.dtype)
        y = jax.lax.dot_general(x, kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        if kernel.dtype == jnp.int8:
            y = y * self.param("kernel_scale", nn.initializers.ones, (self.features,),
                               jnp.float32).astype(self.dtype)
        return y + self._bias() if self.use_bias else y

    def _bias(self) -> jax.Array:
        return self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(self.dtype)


def fused(module: nn.Module, name: str, x: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    """The projections of a decode tree's fused matrix `name` (`cpu_kernels.FUSED`) over x."""
    parts = cpu_kernels.fused_matmul(x, module.get_variable("params", name), sizes)
    return [part.astype(module.dtype) for part in parts]


class Embed(nn.Module):
    """`nn.Embed`, over a float table [vocab, d] or an int8 one with `embedding_scale` [vocab]
    (a row's scale serves its lookup and, tied, its logit)."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype

    def setup(self) -> None:
        # A tied decode tree (`model.cpu_kernels`) holds the table as the head's blocks only.
        self.blocked = (self.get_variable("params", "embedding_blocked")
                        if self.has_variable("params", "embedding_blocked") else None)
        self.embedding = None if self.blocked is not None else self.param(
            "embedding", nn.linear.default_embed_init, (self.num_embeddings, self.features), jnp.float32)
        int8 = (self.blocked if self.blocked is not None else self.embedding).dtype == jnp.int8
        self.scale = (self.param("embedding_scale", nn.initializers.ones, (self.num_embeddings,),
                                 jnp.float32).astype(self.dtype) if int8 else None)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.blocked is not None:
            rows = cpu_kernels.take_columns(self.blocked, tokens).astype(self.dtype)
        else:
            rows = jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)  # convert the rows only
        return rows if self.scale is None else rows * jnp.take(self.scale, tokens)[..., None]

    def attend(self, x: jax.Array) -> jax.Array:
        if self.blocked is not None:
            return cpu_kernels.matmul(x, self.blocked, self.num_embeddings, self.scale).astype(self.dtype)
        logits = jnp.dot(x.astype(self.dtype), self.embedding.astype(self.dtype).T)
        return logits if self.scale is None else logits * self.scale


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    attention: str
    dtype: jnp.dtype
    mesh: jax.sharding.Mesh | None = None  # heads sharded over its tensor-parallel axis

    @nn.compact
    def __call__(self, x, positions, rope, lengths, page_table, k_pages, v_pages, window=None,
                 adapters=None):
        cfg = self.config
        rows, t, _ = x.shape
        dense = lambda n, bias, name: Linear(n, bias, self.dtype, name=name)  # noqa: E731
        widths = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                  cfg.num_kv_heads * cfg.head_dim)
        if self.has_variable("params", "qkv"):  # a decode tree: one kernel call
            q, k, v = fused(self, "qkv", x, widths)
        else:
            q, k, v = (dense(n, cfg.attention_bias, name)(x) for n, name in zip(widths, "qkv"))
        q, k, v = (lora.plus(y, self, name, x, adapters) for y, name in zip((q, k, v), "qkv"))
        q = q.reshape(rows, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(rows, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(rows, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: each head's query and key normalized, then rotated
            q = RMSNorm(cfg.rms_norm_eps, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, name="k_norm")(k)
        if rope is not None:  # (None: a layer without position encoding, SmolLM3's NoPE)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cfg.attention_multiplier is not None:  # Granite's score scale, where every kernel
            q = q * (cfg.attention_multiplier * math.sqrt(cfg.head_dim))  # divides by sqrt(d)

        attend = _write_and_attend(self.attention, *control.form())
        if self.mesh is not None:  # each device writes and reads its own heads' pages
            attend = sharding.per_head(attend, self.mesh)
        windows = () if window is None else (jnp.asarray(window, jnp.int32),)
        with jax.named_scope("attention"):
            out, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, page_table, positions, lengths,
                                           *windows)
        out = out.reshape(rows, t, -1)
        return lora.plus(dense(cfg.hidden_size, False, "o")(out), self, "o", out, adapters), k_pages, v_pages


@functools.cache
def _write_and_attend(attention: str, interpret: bool, branches: bool):
    """Writes a chunk's keys and values into its pages, then attends over them with the paged
    attention named `attention`: one jitted function per form it is traced in (the Pallas
    kernels interpreted or compiled; branches or none: `model.control.form`; a sliding window
    comes as a traced [] int32 argument after the lengths, so every layer shares one trace),
    so every layer of a program calls the one trace of it. A layer's attention is most of
    what tracing a prefill program costs, and tracing is most of what a warm start costs:
    traced once, not once per layer, it takes a 30-layer model's prefill program from ~1.7 s
    to ~0.6 s to trace and lower. XLA inlines the call, so the program is the same."""
    attend = get_paged_attention(attention)
    cpu_kernel = writes_in_place(attention)

    @jax.jit
    def write_and_attend(q, k, v, k_pages, v_pages, page_table, positions, lengths, *window):
        k_pages = paged_kv.write(k_pages, k, page_table, positions, lengths, cpu_kernel=cpu_kernel)
        v_pages = paged_kv.write(v_pages, v, page_table, positions, lengths, cpu_kernel=cpu_kernel)
        extra = {"window": window[0]} if window else {}
        return attend(q, k_pages, v_pages, page_table, positions, **extra), k_pages, v_pages

    return write_and_attend


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, adapters=None):
        f, d = self.config.ffn_size, self.config.hidden_size
        if self.has_variable("params", "gate_up"):  # a decode tree: one kernel call
            gate, up = fused(self, "gate_up", x, (f, f))
        else:
            gate = Linear(f, False, self.dtype, name="gate")(x)
            up = Linear(f, False, self.dtype, name="up")(x)
        gate, up = lora.plus(gate, self, "gate", x, adapters), lora.plus(up, self, "up", x, adapters)
        act = nn.silu(gate) if self.config.hidden_act == "silu" else nn.gelu(gate, approximate=True)
        h = act * up
        return lora.plus(Linear(d, False, self.dtype, name="down")(h), self, "down", h, adapters)


class Block(nn.Module):
    config: ModelConfig
    attention: str
    dtype: jnp.dtype
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x, positions, rope, lengths, page_table, k_pages, v_pages, window=None,
                 adapters=None):
        eps, post = self.config.rms_norm_eps, self.config.post_norms
        h, k_pages, v_pages = Attention(self.config, self.attention, self.dtype, self.mesh, name="attn")(
            RMSNorm(eps, name="attn_norm")(x), positions, rope, lengths, page_table, k_pages, v_pages,
            window, adapters,
        )
        if post:  # (Gemma's: each branch normalized before it joins the residual stream)
            h = RMSNorm(eps, name="attn_post_norm")(h)
        r = self.config.residual_multiplier  # (Granite's; 1 elsewhere)
        x = x + (h if r == 1 else h * r)
        h = MLP(self.config, self.dtype, name="mlp")(RMSNorm(eps, name="mlp_norm")(x), adapters)
        if post:
            h = RMSNorm(eps, name="mlp_post_norm")(h)
        x = x + (h if r == 1 else h * r)
        return x, k_pages, v_pages


class Llama(nn.Module):
    config: ModelConfig
    attention: str = "xla"
    dtype: jnp.dtype = jnp.float32
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, tokens, positions, lengths, cache: PagedKVCache, page_table, logit_index,
                 rope_table=None, hidden=False, adapters=None):
        cfg = self.config
        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, name="embed")
        x = embed(tokens)
        if cfg.embedding_multiplier != 1:  # (Granite's and Gemma's)
            x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        ropes = []  # the layers' (cos, sin), and the sliding layers' own after it if they have one
        for local in (False, True)[:1 + (cfg.rope_local_theta is not None)]:
            if rope_table is None:
                cos, sin = rope_tables(positions, cfg, local)
            else:
                cos, sin = (jnp.take(rope_table[2 * local + i], positions, axis=0, mode="clip")
                            for i in (0, 1))
            ropes.append((cos[:, :, None, :], sin[:, :, None, :]))  # broadcast over heads
        rope = ropes[0]
        if self.has_variable("params", "layers"):  # stacked, run as a loop (`model.layer_loop`)
            block = Block(cfg, self.attention, self.dtype, self.mesh, parent=None)
            windows = [layer_window(cfg, i) for i in range(cfg.num_layers)]
            local = [cfg.local_rope(i) for i in range(cfg.num_layers)]
            x, cache = layer_loop.run(block, self.get_variable("params", "layers"), cfg.num_layers,
                                      x, cache, positions, rope, lengths, page_table,
                                      no_rope=cfg.no_rope_layers,
                                      windows=windows if cfg.sliding_layers else None,
                                      local_rope=(ropes[1], local) if any(local) else None,
                                      adapters=adapters)
        else:
            new_k, new_v = [], []
            for i in range(cfg.num_layers):
                with jax.named_scope(f"layer_{i}"):
                    layer_rope = None if i in cfg.no_rope_layers else ropes[cfg.local_rope(i)]
                    x, k, v = Block(cfg, self.attention, self.dtype, self.mesh, name=f"layers_{i}")(
                        x, positions, layer_rope, lengths, page_table, cache.k[i], cache.v[i],
                        layer_window(cfg, i), adapters,
                    )
                new_k.append(k)
                new_v.append(v)
            cache = PagedKVCache(k=tuple(new_k), v=tuple(new_v))
        if logit_index is not None:
            x = x.reshape(-1, x.shape[-1])[logit_index]  # [n, D]
        x = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
        if hidden:  # the final hidden states (what an embedding pools), not the LM head's logits
            return x.astype(jnp.float32), cache
        with jax.named_scope("lm_head"):
            if cfg.tie_embeddings:
                logits = embed.attend(x)
            else:
                logits = Linear(cfg.vocab_size, False, self.dtype, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        if cfg.logits_scaling != 1:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits, cache


NO_WINDOW = 1 << 30  # a full-attention layer's window, among sliding ones: every position


def layer_window(config: ModelConfig, layer: int) -> int | None:
    """The window `layer`'s attention takes: None where the model has no sliding layers (no
    window is computed at all), else the positions its queries see (`NO_WINDOW`: all)."""
    if not config.sliding_layers:
        return None
    return config.window(layer) or NO_WINDOW


def forward(
    params,
    tokens: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    cache: PagedKVCache,
    page_table: jax.Array,
    *,
    config: ModelConfig,
    logit_index: jax.Array | None = None,
    attention: str = "xla",
    dtype: jnp.dtype = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rope_table: jax.Array | None = None,
    hidden: bool = False,
    adapters: jax.Array | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Runs the decoder; returns float32 logits ([rows, t, V], or [n, V] with logit_index), or
    with `hidden` the final norm's output instead ([rows, t, D] or [n, D]): the hidden states
    an embedding pools, the LM head left out.

    `rope_table`: `rope_table(config, n)` for positions below n, looked up rather than computed
    (the engine's programs pass one); None computes the rotations from the positions.

    `mesh`: attention runs per device over the heads its tensor-parallel axis holds
    (`model.sharding`); the params and pool must be sharded to match. Everything outside
    attention is left to XLA's SPMD partitioner, which follows the shardings of the params.

    `adapters` [rows, slots]: each row's scale for each LoRA adapter of the params' bank
    (`model.lora`); None, or a tree without a bank, runs the base model alone."""
    module = Llama(config, attention, dtype, mesh)
    if adapters is not None and adapters.shape[-1] == 0:
        adapters = None
    return module.apply(
        {"params": params}, tokens, positions, lengths, cache, page_table, logit_index, rope_table,
        hidden, adapters,
    )


def module_tree(config: ModelConfig):
    """The tree the Flax modules themselves build (shapes only), which must be
    `model.params`'s: the check that the modules and the description agree."""
    def init():
        tokens = jnp.zeros((1, 1), jnp.int32)
        return Llama(config).init(jax.random.key(0), tokens, tokens, jnp.ones((1,), jnp.int32),
                                  PagedKVCache.create(config, 1, 1), tokens, None)["params"]

    return jax.eval_shape(init)
