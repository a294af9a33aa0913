"""Where prefill's matmuls should leave the kernel for XLA's GEMM over the dequantized matrix
(`cpu_kernels.gemm_rows`): one prefill chunk of each size through each path, median of 5,
after two warm calls, float32 and int8 activations.

    python bench/results/prefill-blocks-cpu/chunks.py qwen.gguf 48,64,128,256,512
"""
import sys
import time

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
rows = sampling_rows([RequestSampling()])
for activations in ("float32", "int8"):
    for path in ("kernel", "gemm"):
        for n in map(int, sys.argv[2].split(",")):
            # the chunk's rows to the kernel or the GEMM; the logits' one row to the kernel
            threshold = 10**9 if path == "kernel" else n
            cpu_kernels.GEMM_ROWS = threshold
            cpu_kernels.GEMM_ROWS_AVX512 = {"float32": threshold, "int8": threshold}
            engine = Engine(model.params, model.config,
                            EngineConfig(num_slots=1, max_seq_len=1024, prefill_chunk=n, dtype="float32",
                                         attention="cpu", decode_matmul="cpu", cpu_activations=activations),
                            packed=dict(packed))
            table = fixed_page_tables(engine.config)[0]
            prompt = list(np.random.default_rng(0).integers(100, model.config.vocab_size, n))

            def prefill():
                engine.prefill([PrefillChunk(0, prompt, 0, True, table)], rows).block_until_ready()

            prefill(), prefill()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                prefill()
                times.append(time.perf_counter() - start)
            ms = np.median(times) * 1e3
            print(f"{activations:8s} {path:6s} {n:4d} tokens: {ms:6.0f} ms, {n / ms * 1e3:5.0f} tokens/s", flush=True)
