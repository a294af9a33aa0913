#!/usr/bin/env bash
# What one cadence-serve holds resident: once /health says ok, and after two requests (a greedy
# 128-token completion and a sampled 64-token one, whose replies are kept), with its peak.
# $1 label; MODEL the GGUF; CACHE its CADENCE_CACHE; FLAGS more cadence-serve flags; OUT the
# results folder; PYTHON the virtual environment's python. Run from the checkout to serve.
set -uo pipefail
label=$1; out=$(realpath -m ${OUT:-bench/results/resident-cpu}); mkdir -p $out
python=$(realpath -s ${PYTHON:-.venv/bin/python}); port=${PORT:-8124}
CADENCE_CACHE=${CACHE:-$HOME/.cache/cadence} $python -m cadence.server.serve_cli --model=$MODEL \
  --port=$port --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 ${FLAGS:-} > $out/serve-$label.log 2>&1 &
pid=$!
start=$(date +%s)
until curl -sf http://127.0.0.1:$port/health > /dev/null; do
  sleep 1; kill -0 $pid 2>/dev/null || { echo "$label: server died"; tail -5 $out/serve-$label.log; exit 1; }
done
mib() { grep "^$1:" /proc/$pid/status | awk '{printf "%.0f", $2 / 1024}'; }
ready="ready_s=$(( $(date +%s) - start )) ready_rss=$(mib VmRSS)"
ask() { curl -s http://127.0.0.1:$port/v1/completions -H 'content-type: application/json' -d "$1"; }
ask '{"prompt": "def quicksort(arr):", "max_tokens": 128, "temperature": 0}' > $out/reply-$label-greedy.json
ask '{"prompt": "Write a long story about a cat.", "max_tokens": 64, "temperature": 0.7, "seed": 1}' \
  > $out/reply-$label-sampled.json
sleep 1
echo "$label: $ready after_rss=$(mib VmRSS) peak=$(mib VmHWM) MiB; FLAGS=${FLAGS:-}" | tee -a $out/summary.txt
kill $pid; wait $pid 2>/dev/null
