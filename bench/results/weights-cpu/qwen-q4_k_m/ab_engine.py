"""Decode steps of two engines in one process, alternating: the same Q4_K_M checkpoint's float
weights, decode reading its Q8_0 matrices packed and the rest blocked from float32 (what
--weights=auto read before the K-quant kernels) or every matrix it can as packed blocks (after).
`python ab_engine.py FILE.gguf`, run from a checkout's root; median and least of 15 steps."""

import sys
import time

import numpy as np
from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.programs import sampling_rows
from cadence.model.host_sampling import RequestSampling
model = load_model(sys.argv[1])
allp = {p: b for p, (b, k) in model.packed.items()}
q8only = {p: b for p, (b, k) in model.packed.items() if k == "Q8_0"}
for slots in (1, 8):
    engines = {}
    for name, packed in (("float32 + Q8_0 (before)", q8only), ("all packed (after)", allp)):
        engines[name] = Engine(model.params, model.config, EngineConfig(num_slots=slots, max_seq_len=1024, prefill_chunk=128,
                               attention="cpu", decode_matmul="cpu"), packed=packed)
    rows = sampling_rows([RequestSampling()] * slots)
    times = {n: [] for n in engines}
    for n, e in engines.items():
        e.decode(np.full(slots, 127, np.int32), np.ones(slots, bool), rows, fixed_page_tables(e.config), 1).block_until_ready()
    for _ in range(15):
        for n, e in engines.items():
            t = time.perf_counter()
            e.decode(np.full(slots, 127, np.int32), np.ones(slots, bool), rows, fixed_page_tables(e.config), 1).block_until_ready()
            times[n].append(time.perf_counter() - t)
    print(f"slots={slots}: " + ", ".join(f"{n} {np.median(v)*1e3:.1f} ms (min {np.min(v)*1e3:.1f})" for n, v in times.items()), flush=True)
    del engines
