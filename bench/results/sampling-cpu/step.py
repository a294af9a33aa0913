"""The engine's decode step on Qwen2.5-Coder-0.5B Q4_K_M (qwen.gguf in the checkout, from
bench/results/weights-cpu/qwen-q4_k_m/fetch.sh) with every row sampled alike: median of 40
steps per kind, three rounds, 8 slots decoding at 128 tokens, float32, the CPU kernels.

    python bench/results/sampling-cpu/step.py qwen.gguf
"""
import sys
import time

import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.programs import sampling_rows
from cadence.model.host_sampling import RequestSampling

KINDS = {"greedy": RequestSampling(), "temperature": RequestSampling(temperature=1.0, seed=1),
         "nucleus": RequestSampling(temperature=0.7, top_p=0.9, seed=1),
         "sampled": RequestSampling(temperature=0.7, top_p=0.9, top_k=50, seed=1)}
SLOTS = 8

model = load_model(sys.argv[1])
engine = Engine(model.params, model.config,
                EngineConfig(num_slots=SLOTS, max_seq_len=1024, prefill_chunk=128, dtype="float32",
                             attention="cpu", decode_matmul="cpu"),
                packed={path: blocks for path, (blocks, _) in model.packed.items()})
tables = fixed_page_tables(engine.config)
positions = np.full(SLOTS, 127, np.int32)
active = np.ones(SLOTS, bool)
medians = {}
for _ in range(3):
    for name, sampling in KINDS.items():
        rows = sampling_rows([sampling] * SLOTS)
        for _ in range(3):
            engine.decode(positions, active, rows, tables, 1).block_until_ready()
        times = []
        for _ in range(40):
            start = time.perf_counter()
            engine.decode(positions, active, rows, tables, 1).block_until_ready()
            times.append(time.perf_counter() - start)
        medians.setdefault(name, []).append(np.median(times) * 1e3)
for name, ms in medians.items():
    print(f"{name:12s} ms/step " + " ".join(f"{m:6.1f}" for m in ms))
