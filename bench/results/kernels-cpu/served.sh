#!/usr/bin/env bash
# The seed's mixed load (4 closed-loop chats, a 2-3k-token document every ~20 s) served by
# cadence on the CPU kernels, by cadence on XLA's decode (--cpu_kernels=false), and by llama.cpp's
# llama-server on the same GGUF, one server at a time on the same 2 cores as the client: the
# load and server settings of bench/results/llama-server-cpu/run.sh.
# LLAMA_SERVER: the llama-server binary (bench/results/llama-server-cpu/README.md builds it).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/kernels-cpu/served}; mkdir -p $out
gguf=${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}
load=(--chat_concurrency=4 --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05
      --doc_prompt=2000,3000 --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1)

cadence() {  # $1: kernels or xla
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 \
    --cpu_kernels=$([ $1 = kernels ] && echo true || echo false) > $out/serve-cadence-$1.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 "${load[@]}" \
    --out_dir=$out/cadence-$1 > $out/cadence-$1.log 2>&1
  kill $server; wait $server || true
}

llama() {
  "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 --metrics \
    > $out/serve-llama.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; done
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8124/v1 "${load[@]}" \
    --extra_body='{"cache_prompt": false}' --out_dir=$out/llama-server > $out/llama-server.log 2>&1
  kill $server; wait $server || true
}

# ORDER: the servers in turn (the machine drifts, so a second run reverses the first's order).
for server in ${ORDER:-kernels xla llama}; do
  case $server in llama) llama ;; *) cadence $server ;; esac
done
