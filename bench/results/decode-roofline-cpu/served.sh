#!/usr/bin/env bash
# Served decode-only iterations against the engine's step alone, on the CPU kernels (the
# cadence-serve default on this machine): chats only, 1, 4 and 8 at a time, from a client on the
# same cores; then the engine alone at the same slots, in the same session.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/decode-roofline-cpu
.venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 \
  > $out/served-server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
for c in 1 4 8; do
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 --chat_concurrency=$c --doc_rate=0 \
    --chat_prompt=50,200 --chat_output=64,128 --warmup=5 --duration=40 --drain_timeout=60 --seed=2 \
    --out_dir=$out/served/chat$c > /dev/null 2>&1
done
kill $server; wait $server 2>/dev/null || true
.venv/bin/python -m cadence.bench.served_steps $out/served/chat*/run.json > $out/served_steps.txt
.venv/bin/python -m cadence.bench.engine_bench --slots=8 --active=1,4,8 --contexts=128,256 --steps=20 \
  --prompt_tokens=64 --prefill_chunk=64 --attention=cpu --decode_matmul=cpu \
  --out=$out/served-engine.json > $out/served-engine.txt 2>/dev/null
cat $out/served_steps.txt; grep -E '^decode' $out/served-engine.txt
