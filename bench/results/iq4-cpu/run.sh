#!/usr/bin/env bash
# Serving an IQ4_XS GGUF: cadence reading its IQ4_NL / IQ4_XS blocks as stored, against the
# revision before (which dequantized them to float32) and llama-server, one server at a time.
# MODEL: Qwen2.5-Coder-0.5B-Instruct requantized to IQ4_XS by llama.cpp's llama-quantize:
#   llama-quantize --allow-requantize qwen.gguf qwen-iq4_xs.gguf IQ4_XS 2
# (qwen.gguf: ../weights-cpu/qwen-q4_k_m/fetch.sh; Qwen's 896-wide rows take no 256-weight
# super-block, so most matrices fall back to IQ4_NL, the 4864-wide down projections are IQ4_XS).
# BEFORE: a checkout of the revision before IQ4 (git worktree add <dir> d68dd02).
# LLAMA_SERVER: ../llama-server-cpu/README.md builds it. Run from the checkout.
# Another file and folder (../q3k-cpu): OUT the results folder, EXTRA more cadence-serve flags.
set -uo pipefail
here=${OUT:-bench/results/iq4-cpu}
export MODEL=$(realpath -m ${MODEL:-qwen-iq4_xs.gguf})
flags="--kv_cache_dtype=bfloat16 --served_model_name=qwen ${EXTRA:-}"
for round in ${ROUNDS:-1 2}; do
  OUT=$here FLAGS="$flags" bash bench/results/layer-loop-cpu/rate.sh cadence-$round
  OUT=$here FLAGS="$flags --cpu_activations=int8" bash bench/results/layer-loop-cpu/rate.sh cadence-int8-$round
done
if [ -n "${BEFORE:-}" ]; then
  # its own cache folder: the revision before converts the file without the IQ4 blocks
  (cd "$BEFORE" && CADENCE_CACHE=$(mktemp -d) OUT=$OLDPWD/$here PYTHON=$OLDPWD/.venv/bin/python \
     FLAGS="$flags" bash bench/results/layer-loop-cpu/rate.sh cadence-before)
fi
grep -h "weights in" $here/serve-rate-*.log | sort -u > $here/startup.txt
rm -f $here/serve-rate-*.log
OUT=$here bash bench/results/llama-server-cpu/rate.sh
