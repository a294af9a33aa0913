#!/usr/bin/env bash
# The prefix cache's host tier (--host_kv_cache_memory) on this machine: cadence over a KV pool
# too small for the working set (35 pages of 64 tokens: --max_seq_len=2048
# --kv_cache_memory=100MiB, as prefix-cache-cpu's "tinypool"), without and with a 2 GiB host
# tier, one server at a time on the same 2 cores as the client:
#   conversations: 4 concurrent conversations of 5 turns sharing a ~600-token system prompt, each
#                  turn re-sending the history with the replies (greedy, 32 tokens a reply);
#   shared_prefix: 4 prefixes of ~1000 tokens, 8 questions after each, shuffled, 4 in flight.
# ORDER picks the servers and their order (default: device host); OUT moves the results.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/host-kv-cpu}; mkdir -p $out

cadence() {  # $1: label; then cadence-serve flags
  local label=$1; shift
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=2048 --prefill_chunk=128 \
    --kv_cache_memory=100MiB "$@" > $out/serve-$label.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  local url=http://127.0.0.1:8123/v1
  .venv/bin/cadence-bench conversations --base_url=$url --out_dir=$out/$label > $out/$label-conversations.txt 2>&1
  .venv/bin/cadence-bench shared_prefix --base_url=$url --out_dir=$out/$label > $out/$label-shared_prefix.txt 2>&1
  curl -s http://127.0.0.1:8123/metrics \
    | grep -E '^cadence:(prefix_cache|host_kv|kv_pages_(cached|evicted)|num_preemptions)' > $out/$label-metrics.txt
  kill $server; wait $server || true
}

for server in ${ORDER:-device host}; do
  case $server in
    device) cadence device ;;
    host) cadence host --host_kv_cache_memory=2GiB ;;
  esac
done
tail -n 12 $out/*-conversations.txt $out/*-shared_prefix.txt
