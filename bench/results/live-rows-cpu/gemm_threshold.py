"""Whether the 128-token prefill program should take the kernel (with its empty rows skipped)
rather than XLA's GEMM, over float32 activations on an AVX-512 CPU: one prompt of n tokens on
the engine as `prefill.py` builds it, with the GEMM from 128 rows (the default) and from 256
(the 128-token program on the kernel); median of 5 calls after two warm ones.

    python gemm_threshold.py qwen.gguf 72,100,128
"""
import sys
import timeit

import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling

model = load_model(sys.argv[1])
packed = {path: blocks for path, (blocks, _) in model.packed.items()}
rows = sampling_rows([RequestSampling()] * 8)
for gemm in (128, 256):
    cpu_kernels.GEMM_ROWS_AVX512 = {**cpu_kernels.GEMM_ROWS_AVX512, "float32": gemm}
    engine = Engine(model.params, model.config,
                    EngineConfig(num_slots=8, max_seq_len=4096, prefill_chunk=256, dtype="float32",
                                 kv_dtype="bfloat16", attention="cpu", decode_matmul="cpu",
                                 page_size=64, num_pages=512, prefill_tokens=256),
                    packed=dict(packed))
    table = fixed_page_tables(engine.config)[0]
    for n in map(int, sys.argv[2].split(",")):
        prompt = list(np.random.default_rng(0).integers(100, model.config.vocab_size, n))
        chunk = [PrefillChunk(0, prompt, 0, True, table)]
        times = timeit.repeat(lambda: np.asarray(engine.prefill(chunk, rows)), number=1, repeat=7)[2:]
        print(f"GEMM from {gemm:3d} rows: {n:3d} tokens {np.median(times) * 1e3:5.0f} ms", flush=True)
