"""The decoder's layers run as one loop over stacked weights, rather than unrolled.

    reason = layer_loop.unstackable(tree, num_layers)  # None where a decode tree can loop
    tree = layer_loop.stack_layers(tree, num_layers)   # once, where an engine places its weights
    x, cache = layer_loop.run(block, tree["layers"], num_layers, x, cache, ...)  # in the model

Why. XLA:CPU holds a roughly fixed ~140 KiB per compiled kernel, however small, and an unrolled
program repeats every layer's kernels: Qwen2.5-0.5B's 24 layers made each prefill program
hold 44-70 MiB and each decode program 22-36 MiB, 274-388 MiB for a server's eight programs
(`bench/results/resident-cpu/programs/`), and compiling them took most of a first start. As a
`jax.lax.fori_loop` a program holds and compiles one layer's kernels.

What loops. A decode tree (`model.cpu_kernels.decode_params`) whose matrices the CPU kernels
read, with the pool stacked over layers (`PagedKVCache.create(stacked=True)`): each role's
matrices of every layer become one buffer (`cpu_kernels.Stacked`), each in its own format (a
Q4_K_M file mixes Q4_K and Q6_K between layers), and the kernels pick the loop counter's
layer at run time, as they pick a layer of the pool (`cpu_kernels.PoolLayer`); norms and
biases are stacked arrays, indexed by the counter. XLA's and Pallas' paths (and int8 blocks,
`model.quant`'s) stay unrolled: slicing a layer out of a stacked array would copy it, for
every layer of every step.

The loop computes what the unrolled layers compute, kernel for kernel: `tests/test_layer_loop.py`
checks the logits and the pool against the unrolled program's.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import cpu_kernels, host_memory
from cadence.model.paged_kv import PagedKVCache

ALIGN = 64  # bytes: each layer's matrix starts on a cache line


def _layers(tree: dict[str, Any], num_layers: int) -> list[dict[str, Any]]:
    return [tree[f"layers_{i}"] for i in range(num_layers)]


def unstackable(tree: dict[str, Any], num_layers: int) -> str | None:
    """Why a decode tree's layers cannot run as one loop, or None: every layer alike (the same
    leaves, of the same shapes, but for the matrices' formats), every matrix in a format the
    layered kernels read (not int8 blocks)."""
    if any(f"layers_{i}" not in tree for i in range(num_layers)) or "layers" in tree:
        return "the tree does not hold layers_0 .. layers_{n-1}"
    layers = _layers(tree, num_layers)
    flat = [jax.tree_util.tree_flatten_with_path(layer) for layer in layers]
    if any(treedef != flat[0][1] for _, treedef in flat):
        return "the layers' trees differ"
    for leaves in zip(*(leaves for leaves, _ in flat)):
        path = leaves[0][0]
        if cpu_kernels.is_blocked(path):
            if any(cpu_kernels.matrix_format(a) is None for _, a in leaves):
                return f"{jax.tree_util.keystr(path)} has int8 blocks"
            if len({(cpu_kernels.blocked_k(a), a.shape[0]) for _, a in leaves}) != 1:
                return f"{jax.tree_util.keystr(path)} differs in shape between layers"
        elif len({(a.shape, a.dtype) for _, a in leaves}) != 1:
            return f"{jax.tree_util.keystr(path)} differs in shape between layers"
    return None


def _copy_bytes(a, into: np.ndarray) -> None:
    """An array's bytes into `into`. A jax array (on the CPU, laid out row-major) is copied
    from its buffer: read as NumPy, it would keep that view in a reference cycle with it, and
    only the cycle collector would free it, long after its copy was made."""
    if isinstance(a, np.ndarray):
        into[:] = a.reshape(-1).view(np.uint8)
    else:
        a.block_until_ready()
        ctypes.memmove(into.ctypes.data, a.unsafe_buffer_pointer(), a.nbytes)


def stack_matrices(matrices: list[Any]) -> cpu_kernels.Stacked:
    """The layers' matrices of one role in one 64-byte-aligned buffer."""
    sizes = [a.nbytes for a in matrices]
    offsets = np.cumsum([0] + [-(-size // ALIGN) * ALIGN for size in sizes])
    raw = np.empty(offsets[-1] + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    data = raw[start:start + offsets[-1]]
    formats, k, blocks = [], cpu_kernels.blocked_k(matrices[0]), matrices[0].shape[0]
    for i, a in enumerate(matrices):
        formats.append(cpu_kernels.matrix_format(a))
        _copy_bytes(a, data[offsets[i]:offsets[i] + sizes[i]])
        matrices[i] = a = None  # the layer's own array goes as it is copied (where none else holds it)
    return cpu_kernels.Stacked(data, tuple(formats), tuple(int(o) for o in offsets[:-1]), k, blocks)


def stack_arrays(arrays: list[Any]) -> np.ndarray:
    """The layers' arrays of one role that the kernels do not read (norms, biases) on a new
    first axis, each copied from its buffer (`_copy_bytes`) and let go as it is."""
    stacked = np.empty((len(arrays), *arrays[0].shape), np.dtype(arrays[0].dtype))
    for i, a in enumerate(arrays):
        _copy_bytes(a, stacked[i].reshape(-1).view(np.uint8))
        arrays[i] = a = None
    return stacked


def stack_layers(tree: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A decode tree with its `layers_0` .. `layers_{n-1}` replaced by `layers`: each matrix a
    `cpu_kernels.Stacked` of every layer's, every other leaf stacked on a new first axis.
    The layers' own arrays are taken out of `tree` as they are copied and given back after
    each role, so that only one role's matrices are held twice at a time (where nothing else
    holds the layers' arrays)."""
    reason = unstackable(tree, num_layers)
    if reason:
        raise ValueError(f"cannot stack the layers: {reason}")
    layers = [tree.pop(f"layers_{i}") for i in range(num_layers)]
    paths, treedef = jax.tree_util.tree_flatten_with_path(layers[0])
    columns = [[] for _ in paths]
    for layer in layers:
        for j, leaf in enumerate(jax.tree_util.tree_leaves(layer)):
            columns[j].append(leaf)
    layers.clear()
    stacked = []
    for (path, _), column in zip(paths, columns):
        stacked.append(stack_matrices(column) if cpu_kernels.is_blocked(path)
                       else stack_arrays(column))
        column.clear()
        # Nothing read here waits for the cycle collector (a full collection per role cost
        # a second per engine in a large heap); the heap holds the layers' smaller matrices
        # until it is trimmed.
        host_memory.release_free()
    return {**tree, "layers": jax.tree_util.tree_unflatten(treedef, stacked)}


def is_stacked(tree: dict[str, Any]) -> bool:
    """Whether a tree's layers are stacked (`stack_layers`'s)."""
    return isinstance(tree, dict) and "layers" in tree


def host_views(tree: dict[str, Any]) -> dict[str, Any]:
    """A stacked tree with every leaf a NumPy array on the host (jax arrays read in place):
    engines on several CPU devices each place the same buffers, without copying them."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def layer_params(stacked: dict[str, Any], layer: jax.Array) -> dict[str, Any]:
    """One layer's tree, as a `model.llama.Block` reads it: the `Stacked` matrices at `layer`,
    every other leaf's row `layer`."""
    return jax.tree.map(
        lambda a: a.at(layer) if isinstance(a, cpu_kernels.Stacked)
        else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False),
        stacked, is_leaf=lambda a: isinstance(a, cpu_kernels.Stacked))


def run(block, stacked: dict[str, Any], num_layers: int, x: jax.Array, cache: PagedKVCache,
        positions, rope, lengths, page_table, *, no_rope: tuple[int, ...] = (),
        windows: list[int] | None = None, local_rope=None, adapters=None
        ) -> tuple[jax.Array, PagedKVCache]:
    """x through every layer of `block` (an unbound `model.llama.Block`) over `stacked`, in a
    loop whose counter is the layer: each writes its keys and values into its layer of the
    stacked pool and attends over them, as the unrolled layers do, with the block's positions,
    rope (cos, sin), lengths and page table. The layers in `no_rope` rotate by nothing (cos 1,
    sin 0: their queries and keys come out exactly as they went in, as an unrolled layer
    without rope leaves them). `windows`: each layer's attention window (`llama.layer_window`),
    the counter's taken as the loop runs; `local_rope`: ((cos, sin), [layers] bool), the
    rotation the layers marked True take instead of `rope` (Gemma 3's sliding layers);
    `adapters`: each row's LoRA scales (`model.lora`), for the layer's slice of the bank."""
    if not cache.stacked:
        raise ValueError("the layer loop reads a pool stacked over layers "
                         "(PagedKVCache.create(stacked=True))")
    unrotated = np.isin(np.arange(num_layers), no_rope)

    def body(i, carry):
        x, k, v = carry
        layer_rope = rope
        if local_rope is not None:
            (cos, sin), local = local_rope
            on = jnp.asarray(local)[i]
            layer_rope = (jnp.where(on, cos, rope[0]), jnp.where(on, sin, rope[1]))
        if no_rope:
            off = jnp.asarray(unrotated)[i]
            layer_rope = (jnp.where(off, 1.0, layer_rope[0]), jnp.where(off, 0.0, layer_rope[1]))
        window = None if windows is None else jnp.asarray(windows, jnp.int32)[i]
        x, k, v = block.apply({"params": layer_params(stacked, i)}, x, positions, layer_rope, lengths,
                              page_table, cpu_kernels.PoolLayer(k, i), cpu_kernels.PoolLayer(v, i),
                              window, adapters)
        return x, k.pool, v.pool

    x, k, v = jax.lax.fori_loop(0, num_layers, body, (x, cache.k, cache.v))
    return x, PagedKVCache(k=k, v=v)
