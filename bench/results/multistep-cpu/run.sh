#!/usr/bin/env bash
# Served chats with 1, 4 and 8 decode steps per dispatch (cadence-serve --decode_steps), one
# server at a time, the client on the same cores: the commands behind README.md here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/multistep-cpu
for k in 1 4 8; do
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 \
    --decode_steps=$k > $out/serve-k$k.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  for c in 1 4; do
    .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 --chat_concurrency=$c --doc_rate=0 \
      --chat_prompt=50,200 --chat_output=64,128 --warmup=5 --duration=40 --drain_timeout=60 --seed=2 \
      --out_dir=$out/k$k-chat$c > $out/k$k-chat$c.log 2>&1
  done
  kill $server; wait $server || true
done
.venv/bin/python -m cadence.bench.served_steps $out/k{1,4,8}-chat{1,4}/run.json | tee $out/served.txt
