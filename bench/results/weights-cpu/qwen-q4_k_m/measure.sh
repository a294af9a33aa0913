#!/usr/bin/env bash
# One cadence-serve on Qwen2.5-Coder-0.5B-Instruct Q4_K_M: its resident memory once /health
# says ok and after the decode rate run (bench/decode_rate.py: CONC streams, ROUNDS rounds,
# 128 tokens each). $1 label, $2 the checkout to serve (run from its root, so its own code),
# $3 its CADENCE_CACHE (one per revision: their converted-checkpoint formats differ).
# GGUF: the joined file (fetch.sh); PYTHON: the virtual environment's python; OUT: results.
set -uo pipefail
label=$1; checkout=$2; cache=$3; weights=${WEIGHTS:-auto}
python=${PYTHON:-.venv/bin/python}; python=$(realpath -s $python)  # -s: a venv python is a link
out=$(realpath ${OUT:-.}); gguf=$(realpath $GGUF)
cd $checkout
CADENCE_CACHE=$cache $python -m cadence.server.serve_cli --model=$gguf --port=8123 \
  --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 --weights=$weights > $out/serve-$label.log 2>&1 &
server=$!
start=$(date +%s)
until curl -sf http://127.0.0.1:8123/health > /dev/null; do
  sleep 2
  if ! kill -0 $server 2>/dev/null; then echo "server died"; tail -20 $out/serve-$label.log; exit 1; fi
done
echo "$label: ready after $(( $(date +%s) - start )) s" | tee -a $out/summary.txt
echo "$label: after load: $(grep -E 'VmRSS|VmHWM' /proc/$server/status | tr -s ' ' | tr '\n' ' ')" | tee -a $out/summary.txt
$python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8123/v1 \
  --model=$(basename $gguf .gguf) --concurrency=${CONC:-1} --rounds=${ROUNDS:-3} --max_tokens=128 \
  --label=cadence-$label --out=$out/rate-$label.json > $out/rate-$label.log 2>&1
grep "stream(s)\|ms per token" $out/rate-$label.log | tee -a $out/summary.txt
echo "$label: after decode: $(grep -E 'VmRSS|VmHWM' /proc/$server/status | tr -s ' ' | tr '\n' ' ')" | tee -a $out/summary.txt
kill $server; wait $server
