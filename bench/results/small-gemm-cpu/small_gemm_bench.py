"""How fast XLA:CPU reads weights in the 1-32-row matmuls of a decode step, by formulation.

    python bench/results/small-gemm-cpu/small_gemm_bench.py      # XLA_FLAGS=... to try compiler flags

A decode step multiplies a few rows (the decoding slots) by every weight matrix, so it should
run at the speed of reading the weights. This times a chain of 30 matmuls of SmolLM2-135M's MLP
shape (576 x 1536, f32, 106 MiB: too big for any cache) for several row counts, as a dot with
the weight stored [in, out] and [out, in], as a fused multiply-and-reduce, and as cadence's CPU
kernel over the blocked layout (`model.cpu_kernels`, where it builds), and prints the weight
bytes read per second beside this machine's plain read bandwidth (a large sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.bench import roofline
from cadence.model import cpu_kernels

_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32"], "Row counts.")
_REDUCE = flags.DEFINE_bool("reduce", True, "Also time the multiply-and-reduce formulations (slow).")

D, F, LAYERS = 576, 1536, 30


def timed(fn, *args, repeats: int = 30) -> float:
    return roofline.timed(lambda: fn(*args), repeats)


def chain(step):
    """x [rows, D] through every weight, each result folded back into x (so none is dead)."""
    def run(x, weights):
        for w in weights:
            x = x + step(x, w)[:, :D]
        return x
    return jax.jit(run)


FORMULATIONS = {  # name -> (weight layout, one layer's x @ W)
    "kernel [blocked]": ("blocked", lambda x, w: cpu_kernels.blocked_matmul(x, w, F)),
    "dot [in,out]": ("in_out", lambda x, w: x @ w),
    "dot [out,in]": ("out_in", lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))),
    "reduce [out,in]": ("out_in", lambda x, w: jnp.sum(x[:, None, :] * w[None], axis=-1)),
    "reduce [in,out]": ("in_out", lambda x, w: jnp.sum(x[:, :, None] * w[None], axis=1)),
}


def main(argv) -> None:
    del argv
    bandwidth = roofline.measure_bandwidth()  # 256 MiB read on the device, median of 5
    rng = np.random.default_rng(0)
    weights = {"in_out": [jnp.asarray(rng.standard_normal((D, F), np.float32)) for _ in range(LAYERS)]}
    weights["out_in"] = [w.T.copy() for w in weights["in_out"]]
    weights["blocked"] = [cpu_kernels.block(w) for w in weights["in_out"]]
    nbytes = sum(w.nbytes for w in weights["in_out"])
    print(f"{jax.devices()[0]}, JAX {jax.__version__}: plain read {bandwidth / 1e9:.1f} GB/s; "
          f"{LAYERS} x [{D}, {F}] f32 = {nbytes / 2**20:.0f} MiB, floor {nbytes / bandwidth * 1e3:.2f} ms")
    names = [n for n in FORMULATIONS if (_REDUCE.value or not n.startswith("reduce"))
             and (cpu_kernels.available() or not n.startswith("kernel"))]
    print(f"{'rows':>5} " + " ".join(f"{n:>24}" for n in names) + "   (ms, weight GB/s)")
    for rows in map(int, _ROWS.value):
        x = jnp.ones((rows, D), jnp.float32)
        cells = []
        for name in names:
            layout, step = FORMULATIONS[name]
            seconds = timed(chain(step), x, weights[layout])
            cells.append(f"{seconds * 1e3:7.2f} ms {nbytes / seconds / 1e9:5.1f} GB/s")
        print(f"{rows:>5} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    app.run(main)
