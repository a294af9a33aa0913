#!/usr/bin/env bash
# Decode rate of one cadence-serve: 1 and 8 streams of 128 tokens, 3 rounds each
# (`cadence.bench.decode_rate`), then the server's resident memory. $1 label; MODEL the GGUF;
# FLAGS more cadence-serve flags; OUT the results folder. Run from the checkout to serve.
set -uo pipefail
label=$1; out=$(realpath -m ${OUT:-bench/results/layer-loop-cpu}); mkdir -p $out
python=$(realpath -s ${PYTHON:-.venv/bin/python}); port=${PORT:-8125}
$python -m cadence.server.serve_cli --model=$MODEL --port=$port --num_slots=8 \
  --max_seq_len=4096 ${FLAGS:-} > $out/serve-rate-$label.log 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:$port/health > /dev/null; do
  sleep 1; kill -0 $pid 2>/dev/null || { echo "$label: server died"; tail -5 $out/serve-rate-$label.log; exit 1; }
done
$python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:$port/v1 --model=qwen \
  --concurrency=1,8 --rounds=3 --max_tokens=128 --label=$label --out=$out/rate-$label.json \
  2>&1 | grep "stream(s)" | tee -a $out/rates.txt
echo "$label: rss=$(grep VmRSS /proc/$pid/status | awk '{printf "%.0f", $2 / 1024}') MiB; FLAGS=${FLAGS:-}" | tee -a $out/rates.txt
kill $pid; wait $pid 2>/dev/null
