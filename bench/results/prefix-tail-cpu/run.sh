#!/usr/bin/env bash
# Partial-page prefix hits: the prefix-cache workloads of ../prefix-cache-cpu/ (multi-turn
# conversations sharing a ~600-token system prompt; shared ~1000-token prefixes with questions)
# on cadence before and after the cache reused partial pages, and on llama-server, one server
# at a time on the same 2 cores as the client, ROUNDS times (default 2) in turn.
#   BEFORE=<checkout of the code before>  served from its own directory (python -m puts the
#                                         working directory first on sys.path)
#   LLAMA_SERVER=<binary>                  ../llama-server-cpu/README.md builds it
#   GGUF=<model>                           default: SmolLM2-135M-Instruct Q4_1 (cadence's default)
#   WORKLOADS="conversations shared_prefix" (default); "mixed": the seed's mixed load as in
#                                         ../prefix-cache-cpu/ (no shared prefixes but the
#                                         chat template's)
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/prefix-tail-cpu}; mkdir -p $out
python=$(realpath -s .venv/bin/python)
gguf=$(realpath ${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf})

mixed=(--chat_concurrency=4 --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05
       --doc_prompt=2000,3000 --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1)

workloads() {  # label base-url
  for workload in ${WORKLOADS:-conversations shared_prefix}; do
    case $workload in
      mixed) $python -m cadence.bench.cli run --base_url=$2 "${mixed[@]}" --out_dir=$out/$1/mixed > $out/$1-mixed.txt 2>&1 ;;
      *) $python -m cadence.bench.cli $workload --base_url=$2 --out_dir=$out/$1 > $out/$1-$workload.txt 2>&1 ;;
    esac
  done
}

cadence() {  # label [checkout]
  (cd ${2:-.} && exec $python -m cadence.server.serve_cli --model=$gguf --port=8123 --num_slots=8 \
    --max_seq_len=4096 --prefill_chunk=128 --served_model_name=smollm2-135m) > ${TMPDIR:-/tmp}/serve-$1.log 2>&1 &
  local server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do
    sleep 2; kill -0 $server 2>/dev/null || { echo "$1: server died"; tail -5 ${TMPDIR:-/tmp}/serve-$1.log; return 1; }
  done
  workloads $1 http://127.0.0.1:8123/v1
  [ "${WORKLOADS:-}" != mixed ] && curl -s http://127.0.0.1:8123/metrics | grep -E '^cadence:(prefix_cache|kv_pages_(cached|evicted))' > $out/$1-metrics.txt
  kill $server; wait $server || true
}

llama() {  # label
  "$LLAMA_SERVER" -m $gguf --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
  local server=$!
  until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; done
  workloads $1 http://127.0.0.1:8124/v1
  kill $server; wait $server || true
}

for round in $(seq ${ROUNDS:-2}); do
  [ -n "${BEFORE:-}" ] && cadence before-$round $BEFORE
  cadence after-$round
  [ -n "${LLAMA_SERVER:-}" ] && llama llama-server-$round
done
tail -n 12 $out/*-conversations.txt $out/*-shared_prefix.txt 2>/dev/null
