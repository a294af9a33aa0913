"""What cadence-serve's compiled programs hold resident: the process's RSS before warm-up,
after each program compiles (or loads from the compilation cache), and after
`jax.clear_caches()` drops them, with the mappings that memory came from (/proc/self/smaps).

    python bench/results/resident-cpu/programs/programs.py --model=qwen.gguf --num_slots=8 \
        --max_seq_len=4096 --prefill_chunk=128 --kv_cache_dtype=bfloat16 --warmup_threads=1

Takes cadence-serve's flags; builds the runtime as the server does, without serving.
NO_XLA_CACHE=1 compiles every program rather than loading it from the compilation cache.
"""

import collections
import gc
import os

import jax
from absl import app

from cadence.server import memory, runtime


def mib() -> float:
    memory.release_free()
    return memory.resident().now / 2**20


def mappings() -> collections.Counter:
    """Resident KiB by (permissions, kind) of mapping."""
    held, key = collections.Counter(), None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" not in parts[0]:
            name = parts[5] if len(parts) > 5 else "[anon]"
            key = (parts[1], "file" if name.startswith("/") else name)
        elif parts[0] == "Rss:":
            held[key] += int(parts[1])
    return held


def main(argv):
    del argv
    built = runtime.build_from_flags(warm=False)
    if os.environ.get("NO_XLA_CACHE"):  # compile every program here, not load it
        jax.config.update("jax_enable_compilation_cache", False)
    before = mib()
    print(f"before warm-up: {before:.0f} MiB", flush=True)
    last = [before]

    def compiled(done, total, name):
        if name:
            now = mib()
            print(f"{name}: {now:.0f} MiB (+{now - last[0]:.0f})", flush=True)
            last[0] = now

    built.warm_up(compiled)
    warm, held = mib(), mappings()
    jax.clear_caches()
    gc.collect()
    cleared, left = mib(), mappings()
    print(f"after warm-up: {warm:.0f} MiB; after jax.clear_caches(): {cleared:.0f} MiB "
          f"(the programs held {warm - cleared:.0f} MiB)")
    for key in sorted(set(held) | set(left), key=lambda k: left[k] - held[k]):
        if abs(held[key] - left[key]) > 5 * 1024:
            print(f"  {key}: {held[key] / 1024:.0f} -> {left[key] / 1024:.0f} MiB")


if __name__ == "__main__":
    app.run(main)
