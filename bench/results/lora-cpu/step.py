"""What LoRA adapters cost a decode step and a prefill chunk: the engine's programs on a model
(default SmolLM2-135M-Instruct; a GGUF path as the first argument), CPU kernels and layer loop,
greedy, at 1 and 8 slots decoding at position 128, median and fastest of 40 steps, for

    none     no bank (the engine without --lora)
    unused   a bank of 4 adapters of rank 16 on every projection, no row using one
    all      the same bank, every row on adapter 0
    mixed    every row on a mix of two adapters (llama-server's scales)

and a 256-token prefill chunk alone. The adapters are random (their values change no cost).

    python bench/results/lora-cpu/step.py [model]
"""
import sys
import time

import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model import lora
from cadence.model.host_sampling import RequestSampling

SLOTS, RANK = 4, 16
model = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
rng = np.random.default_rng(0)
adapters = []
for i in range(SLOTS):
    weights = {}
    for layer in range(model.config.num_layers):
        for proj in lora.PROJECTIONS:
            n_in, n_out = lora.projection_shape(model.config, proj)
            weights[(layer, proj)] = (rng.normal(0, 0.01, (n_in, RANK)).astype(np.float32),
                                      rng.normal(0, 0.01, (RANK, n_out)).astype(np.float32))
    adapters.append(lora.LoraAdapter(f"a{i}", RANK, weights))
packed = {p: b for p, (b, _) in model.packed.items()}
CASES = {"none": None, "unused": (), "all": ((0, 1.0),), "mixed": ((0, 0.5), (1, 1.0))}


def timed(fn, n=40):
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return np.median(times) * 1e3, np.min(times) * 1e3


print(f"{model.name}: {model.config.num_layers} layers, bank of {SLOTS} adapters x rank {RANK} on "
      f"{', '.join(lora.PROJECTIONS)}")
for slots in (1, 8):
    engines = {}
    for case, pairs in CASES.items():
        bank = pairs is not None
        key = "bank" if bank else "none"
        if key not in engines:
            engines[key] = Engine(model.params, model.config, EngineConfig(
                num_slots=slots, max_seq_len=1024, prefill_chunk=256, attention="cpu",
                decode_matmul="cpu", lora_slots=SLOTS if bank else 0, lora_rank=RANK if bank else 0),
                packed=dict(packed), adapters=adapters if bank else ())
        engine = engines[key]
        rows = sampling_rows([RequestSampling(lora=pairs or ())] * slots, engine.config.lora_slots)
        tables = fixed_page_tables(engine.config)
        positions, active = np.full(slots, 128, np.int32), np.ones(slots, bool)
        step = timed(lambda: engine.decode(positions, active, rows, tables, 1).block_until_ready())
        prompt = list(rng.integers(3, 1000, 256))
        chunk = timed(lambda: np.asarray(engine.prefill([PrefillChunk(0, prompt, 0, True, tables[0])], rows)),
                      n=10)
        print(f"slots={slots} {case:7s} decode step median {step[0]:6.2f} ms  min {step[1]:6.2f}   "
              f"256-token prefill median {chunk[0]:7.1f} ms  min {chunk[1]:7.1f}")
