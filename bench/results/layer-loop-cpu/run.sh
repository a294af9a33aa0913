#!/usr/bin/env bash
# The layer loop against the unrolled layers (--nolayer_loop), on Qwen2.5-Coder-0.5B Q4_K_M
# and the 3B-shaped Q4_K_M (qwen.gguf, q3b.gguf in the checkout: ../resident-cpu/README.md),
# one after another on an otherwise idle machine, every server with a bfloat16 pool:
# the programs' memory compiled and loaded from the compilation cache, each server's resident
# memory after two requests (../resident-cpu/run.sh), and decode rates (rate.sh).
set -uo pipefail
here=bench/results/layer-loop-cpu
programs=bench/results/resident-cpu/programs/programs.py
flags="--num_slots=8 --max_seq_len=4096 --prefill_chunk=128 --kv_cache_dtype=bfloat16 --warmup_threads=1"
for label in loop unrolled; do
  extra=$([ $label = unrolled ] && echo --nolayer_loop)
  NO_XLA_CACHE=1 .venv/bin/python $programs --model=qwen.gguf $flags $extra 2>/dev/null > $here/programs-qwen-$label-compiled.txt
  .venv/bin/python $programs --model=qwen.gguf $flags $extra 2>/dev/null > $here/programs-qwen-$label-loaded.txt
done
for model in qwen q3b; do
  for label in loop unrolled; do
    extra=$([ $label = unrolled ] && echo --nolayer_loop)
    OUT=$here MODEL=$model.gguf FLAGS="--kv_cache_dtype=bfloat16 $extra" \
      bash bench/results/resident-cpu/run.sh $model-$label
  done
done
for round in 1 2; do
  for label in loop unrolled; do
    extra=$([ $label = unrolled ] && echo --nolayer_loop)
    MODEL=qwen.gguf FLAGS="--kv_cache_dtype=bfloat16 $extra" bash $here/rate.sh $label-$round
  done
done
MODEL=qwen.gguf FLAGS="--kv_cache_dtype=bfloat16 --cpu_activations=int8" bash $here/rate.sh loop-int8
MODEL=qwen.gguf FLAGS="--kv_cache_dtype=bfloat16 --cpu_activations=int8 --nolayer_loop" bash $here/rate.sh unrolled-int8
# llama-server on the same file, for the decode rates' comparison (../resident-cpu/README.md
# says how it is built; LLAMA_SERVER its path).
$LLAMA_SERVER -m qwen.gguf --port 8001 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
.venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8001/v1 --model=qwen \
  --concurrency=1,8 --rounds=3 --max_tokens=128 --label=llama-server \
  --extra_body='{"cache_prompt": false}' --out=$here/rate-llama-server.json | grep "stream(s)"
kill %1
