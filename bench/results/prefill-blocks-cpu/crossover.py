"""Where `cpu_kernels.matmul` should switch from the kernel to XLA's GEMM over the dequantized
matrix: both timed at several row counts over one model's matrices in its own formats.

    python bench/results/prefill-blocks-cpu/crossover.py [MODEL] [ROWS]

For each row count, the summed time of every matrix of one layer (q/k/v and gate/up fused, as
the engine holds them), median of 9, by the kernel (`blocked_matmul`) and by
dequantize-then-dot."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.model import cpu_kernels

model = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
rows_list = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "8,16,32,48,64,96,128,256").split(",")]
tree = cpu_kernels.decode_params(model.params, {p: b for p, (b, _) in model.packed.items()})
layer = tree["layers_0"]
matrices = [leaf["kernel_blocked"] for group in layer.values() if isinstance(group, dict)
            for leaf in group.values() if isinstance(leaf, dict) and "kernel_blocked" in leaf]
matrices = [jnp.asarray(m) for m in matrices]
kernel = jax.jit(lambda x, w: cpu_kernels.blocked_matmul(x, w, w.shape[0] * 16))
gemm = jax.jit(lambda x, w: jnp.dot(x, cpu_kernels.dequantize(w, w.shape[0] * 16)))
for rows in rows_list:
    out = {}
    for name, f in (("kernel", kernel), ("gemm", gemm)):
        total = 0.0
        for w in matrices:
            k = w.shape[1] * (cpu_kernels.FORMATS[cpu_kernels.grouped_format(w)][0] if w.dtype == jnp.uint8 else 1)
            x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, k), np.float32))
            f(x, w).block_until_ready()
            times = []
            for _ in range(9):
                t = time.perf_counter()
                f(x, w).block_until_ready()
                times.append(time.perf_counter() - t)
            total += float(np.median(times))
        out[name] = total
    print(f"rows {rows:4d}: kernel {out['kernel'] * 1e3:7.2f} ms, dequantize + GEMM {out['gemm'] * 1e3:7.2f} ms "
          f"({out['kernel'] / out['gemm']:.2f}x)", flush=True)
