#!/usr/bin/env bash
# The grouped kernels' AVX-512 tiles (eight rows a pass; VNNI over int8 activations) against
# their AVX2 ones (CADENCE_CPU_AVX512=0) on Qwen2.5-Coder-0.5B Q4_K_M (qwen.gguf in the
# checkout: ../weights-cpu/qwen-q4_k_m/fetch.sh), then llama-server on the same file
# (LLAMA_SERVER its path; ../llama-server-cpu/README.md builds it), one after another on an
# otherwise idle machine. Rates by ../layer-loop-cpu/rate.sh, bfloat16 pool.
set -uo pipefail
here=bench/results/avx512-cpu
rate=bench/results/layer-loop-cpu/rate.sh
for round in ${ROUNDS:-1 2}; do
  for avx512 in 1 0; do
    for act in float32 int8; do
      CADENCE_CPU_AVX512=$avx512 OUT=$here MODEL=qwen.gguf \
        FLAGS="--kv_cache_dtype=bfloat16 --cpu_activations=$act" bash $rate avx512=$avx512-$act-$round
    done
  done
done
OUT=$here MODEL=qwen.gguf bash bench/results/llama-server-cpu/rate.sh
