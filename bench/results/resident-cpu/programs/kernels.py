"""XLA:CPU's resident cost per compiled kernel: a program of n steps, each an elementwise
fusion and a reduction (two kernels), compiled but not run; RSS before and after.

    python bench/results/resident-cpu/programs/kernels.py 256 1024    # steps, array length
"""

import ctypes
import sys

import jax
import jax.numpy as jnp

libc = ctypes.CDLL("libc.so.6")


def mib() -> float:
    libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def program(x, steps):
    for i in range(steps):
        x = jnp.sin(x * (i + 1.5)) + jnp.cos(x)
        x = x / jnp.sum(x)  # a reduction between steps keeps them from fusing
    return x


steps, length = int(sys.argv[1]), int(sys.argv[2])
x = jnp.ones((length,), jnp.float32)
start = mib()
jax.jit(program, static_argnums=1).lower(x, steps).compile()
grown = mib() - start
print(f"{steps} steps of {length} floats: +{grown:.1f} MiB, {grown * 1024 / steps:.0f} KiB a step")
