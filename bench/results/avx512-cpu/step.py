"""The engine's decode step on Qwen2.5-Coder-0.5B Q4_K_M (qwen.gguf in the checkout): median
and fastest of 30 steps, at each slot count and activations given, all slots decoding at 128
tokens, greedy, a float32 pool.

    python bench/results/avx512-cpu/step.py 1,8 float32,int8
"""
import sys, time, numpy as np
from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.programs import sampling_rows
from cadence.model.host_sampling import RequestSampling
model = load_model("qwen.gguf")
packed = {p: b for p, (b, _) in model.packed.items()}
for act in sys.argv[2].split(","):
  for slots in map(int, sys.argv[1].split(",")):
    engine = Engine(model.params, model.config, EngineConfig(num_slots=slots, max_seq_len=4096, prefill_chunk=128,
                    dtype="float32", attention="cpu", decode_matmul="cpu", cpu_activations=act), packed=dict(packed))
    rows = sampling_rows([RequestSampling()] * slots)
    tables = fixed_page_tables(engine.config)
    positions = np.full(slots, 127, np.int32); active = np.ones(slots, bool)
    for _ in range(3): engine.decode(positions, active, rows, tables, 1).block_until_ready()
    times = []
    for _ in range(30):
        t = time.perf_counter(); engine.decode(positions, active, rows, tables, 1).block_until_ready(); times.append(time.perf_counter() - t)
    print(f"{act} slots={slots} step median {np.median(times)*1e3:.2f} ms  min {np.min(times)*1e3:.2f}")
