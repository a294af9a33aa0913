#!/usr/bin/env bash
# The prefix cache (issue 24) on this machine, one server at a time on the same 2 cores as the
# client: cadence with the cache, cadence with --noprefix_caching, and llama.cpp's llama-server
# (its per-slot prompt cache on, as it is by default) on the same GGUF.
#   conversations: 4 concurrent conversations of 5 turns sharing a ~600-token system prompt, each
#                  turn re-sending the history with the replies (greedy, 32 tokens a reply);
#   shared_prefix: 4 prefixes of ~1000 tokens, 8 questions after each, shuffled, 4 in flight;
#   mixed:         the seed's mixed load (no shared prefixes), cadence with and without the cache.
# ORDER picks the servers and their order (default: cache nocache llama; also page16, smallpool);
# MIXED= (empty) skips the mixed load; OUT moves the results.
# LLAMA_SERVER: the llama-server binary (bench/results/llama-server-cpu/README.md builds it).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/prefix-cache-cpu}; mkdir -p $out
gguf=${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}
mixed=(--chat_concurrency=4 --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05
       --doc_prompt=2000,3000 --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1)

workloads() {  # $1: label, $2: base URL; then extra cadence-bench flags
  local label=$1 url=$2; shift 2
  .venv/bin/cadence-bench conversations --base_url=$url "$@" --out_dir=$out/$label > $out/$label-conversations.txt 2>&1
  .venv/bin/cadence-bench shared_prefix --base_url=$url "$@" --out_dir=$out/$label > $out/$label-shared_prefix.txt 2>&1
}

cadence() {  # $1: label; then cadence-serve flags
  local label=$1; shift
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 "$@" \
    > $out/serve-$label.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  workloads $label http://127.0.0.1:8123/v1
  if [ -n "${MIXED-1}" ]; then
    .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 "${mixed[@]}" \
      --out_dir=$out/$label/mixed > $out/$label-mixed.txt 2>&1
  fi
  curl -s http://127.0.0.1:8123/metrics | grep -E '^cadence:(prefix_cache|kv_pages_(cached|evicted)|num_preemptions)' \
    > $out/$label-metrics.txt
  kill $server; wait $server || true
}

llama() {
  "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 --metrics \
    > $out/serve-llama.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; done
  workloads llama-server http://127.0.0.1:8124/v1
  kill $server; wait $server || true
}

for server in ${ORDER:-cache nocache llama}; do
  case $server in
    cache) cadence cadence ;;
    nocache) cadence cadence-nocache --noprefix_caching ;;
    page16) cadence cadence-page16 --page_size=16 ;;  # a finer cache: less of each prompt recomputed
    smallpool) cadence cadence-smallpool --kv_cache_memory=200MiB ;;  # 71 pages: one 4k sequence and a little
    tinypool) cadence cadence-tinypool --max_seq_len=2048 --kv_cache_memory=100MiB ;;  # 35 pages: too few
    llama) llama ;;
  esac
done
tail -n 12 $out/*-conversations.txt $out/*-shared_prefix.txt
