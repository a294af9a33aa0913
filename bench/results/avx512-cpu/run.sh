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
$LLAMA_SERVER -m qwen.gguf --port 8001 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
for round in ${ROUNDS:-1 2}; do
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8001/v1 --model=qwen \
    --concurrency=1,8 --rounds=3 --max_tokens=128 --label=llama-server-$round \
    --extra_body='{"cache_prompt": false}' --out=$here/rate-llama-server-$round.json \
    | grep "stream(s)" | tee -a $here/rates.txt
done
kill %1
