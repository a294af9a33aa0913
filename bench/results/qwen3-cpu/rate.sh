#!/usr/bin/env bash
# Decode and short-prompt rates on a Qwen3-0.6B-shaped GGUF of random weights in llama.cpp's
# Q4_K_M mix (`cadence.bench.random_gguf --shape=qwen3-0.6b`, the tokenizer of a Qwen2.5 GGUF:
# TOKENIZER, default qwen.gguf, ../weights-cpu/qwen-q4_k_m/fetch.sh), cadence then llama-server
# (LLAMA_SERVER its path; ../llama-server-cpu/README.md builds it), one after the other on an
# otherwise idle machine: 1 and 8 streams of 128 tokens, 3 rounds each, twice. cadence runs with
# --speculative=off (the random model's noise repeats itself, which prompt lookup would exploit
# as no real answer lets it) and a 16-bit KV pool, as llama-server's (Qwen3-0.6B keeps 8 KV heads
# of 128: 112 KiB a token in 16 bits, 3.5 GiB for the 8 x 4096 tokens both hold). Run from the
# checkout.
set -uo pipefail
here=bench/results/qwen3-cpu
model=${MODEL:-qwen3-0.6b-shape.gguf}
[ -f "$model" ] || .venv/bin/python -m cadence.bench.random_gguf --shape=qwen3-0.6b \
  --tokenizer_from=${TOKENIZER:-qwen.gguf} --out="$model"
for round in ${ROUNDS:-1 2}; do
  OUT=$here MODEL=$model FLAGS="--speculative=off --kv_cache_dtype=bfloat16 --served_model_name=qwen" \
    bash bench/results/layer-loop-cpu/rate.sh cadence-$round
done
rm -f $here/serve-rate-*.log
OUT=$here MODEL=$model bash bench/results/llama-server-cpu/rate.sh
