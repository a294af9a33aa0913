#!/usr/bin/env bash
# The CPU decode kernels (model/cpu_kernels.cc) against XLA's decode, in one session on the same
# machine: the kernels alone against their XLA twins, then the engine's decode step both ways
# (twice each, alternating, as this shared 2-core machine drifts). The commands behind README.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/kernels-cpu
.venv/bin/python bench/results/small-gemm-cpu/small_gemm_bench.py --rows=1,2,4,8,16 --noreduce > $out/small_gemm.txt 2>/dev/null
.venv/bin/python bench/results/paged-attention-cpu/paged_attention_bench.py --rounds=15 --calls=8 --page_sizes=64 \
  --out=$out/paged_attention.txt > /dev/null 2>&1
engine=(--slots=1,8 --contexts=128,1024 --prompt_tokens=512 --steps=30)
for run in 1 2; do
  .venv/bin/python -m cadence.bench.engine_bench "${engine[@]}" --attention=xla --decode_matmul=xla \
    --out=$out/engine-xla-$run.json > $out/engine-xla-$run.txt 2>/dev/null
  .venv/bin/python -m cadence.bench.engine_bench "${engine[@]}" --attention=cpu --decode_matmul=cpu \
    --out=$out/engine-cpu-$run.json > $out/engine-cpu-$run.txt 2>/dev/null
done
for weights in int8 float; do  # int8 blocks against float32, back to back
  .venv/bin/python -m cadence.bench.engine_bench "${engine[@]}" --attention=cpu --decode_matmul=cpu \
    --weights=$weights --out=$out/engine-cpu-$weights-3.json > $out/engine-cpu-$weights-3.txt 2>/dev/null
done
grep -h -E '^(machine|decode|prefill)' $out/engine-*.txt
