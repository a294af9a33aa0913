"""Prefill of one prompt of n tokens on the engine as cadence-serve builds it on the CPU (8
slots of 4096 tokens, pages of 64, bfloat16 pool, the GGUF's own blocks on the CPU kernels),
float32 and int8 activations: median of 5 calls after two warm ones. A prompt of n tokens
fills ceil(n / 16) rows of 16 and runs in the smallest prefill bucket (16, 32, ..., 256 tokens)
that holds them.

    python prefill.py qwen.gguf 33,42,48,64,72,100,128,144,200,256

Run with the working directory a checkout and this file copied there (`import cadence` then
reads that checkout's code: the script's own directory comes first on sys.path).
"""
import sys
import timeit

import numpy as np

import cadence
from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model.host_sampling import RequestSampling

print("# code:", cadence.__file__.rsplit("/cadence/", 1)[0].rsplit("/", 1)[-1], flush=True)
model = load_model(sys.argv[1])
packed = {path: blocks for path, (blocks, _) in model.packed.items()}
rows = sampling_rows([RequestSampling()] * 8)
for activations in ("float32", "int8"):
    engine = Engine(model.params, model.config,
                    EngineConfig(num_slots=8, max_seq_len=4096, prefill_chunk=256, dtype="float32",
                                 kv_dtype="bfloat16", attention="cpu", decode_matmul="cpu",
                                 cpu_activations=activations, page_size=64, num_pages=512,
                                 prefill_tokens=256),
                    packed=dict(packed))
    table = fixed_page_tables(engine.config)[0]
    for n in map(int, sys.argv[2].split(",")):
        prompt = list(np.random.default_rng(0).integers(100, model.config.vocab_size, n))

        def prefill():
            np.asarray(engine.prefill([PrefillChunk(0, prompt, 0, True, table)], rows))

        times = timeit.repeat(prefill, number=1, repeat=7)[2:]  # two warm calls, five timed
        print(f"{activations:8s} {n:4d} tokens: {np.median(times) * 1e3:5.0f} ms", flush=True)
