#!/usr/bin/env bash
# The seed's mixed load (closed-loop chats beside a 2-3k-token document every ~20 s), with
# speculative decoding off and on: both servers side by side, runs alternating, the client on
# the same cores. Chats at 1 and 4 streams: speculation applies while one request decodes alone.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/speculative-cpu
source $out/servers.sh
start_servers --num_slots=8 --max_seq_len=4096 --prefill_chunk=128
for chats in 1 4; do
  for mode in $modes; do
    .venv/bin/cadence-bench run --base_url=http://127.0.0.1:$(port_of $mode)/v1 --chat_concurrency=$chats \
      --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05 --doc_prompt=2000,3000 \
      --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1 \
      --out_dir=$out/mixed-chat$chats-$mode > $out/mixed-chat$chats-$mode.log 2>&1
  done
done
