#!/usr/bin/env bash
# One stream and eight streams on an idle server, cadence in each weight format against
# llama.cpp's llama-server on the same GGUF (SmolLM2-135M-Instruct Q4_1), one server at a time
# on the same 2 cores as the client (bench/decode_rate.py). Then the seed's mixed load on cadence's
# default and on llama-server (as bench/results/llama-server-cpu/run.sh). LLAMA_SERVER: the
# llama-server binary (bench/results/llama-server-cpu/README.md says how it was built).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/weights-cpu}; mkdir -p $out
gguf=${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}
rate=(--concurrency=1,8 --rounds=${ROUNDS:-5} --max_tokens=256)

serve_cadence() {  # $1: --weights value
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 \
    --weights=$1 > $out/serve-cadence-$1.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
}
serve_llama() {
  "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 \
    > $out/serve-llama.log 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; done
}

for weights in ${WEIGHTS:-auto float int8 int4}; do
  serve_cadence $weights
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8123/v1 "${rate[@]}" \
    --label=cadence-$weights --out=$out/rate-cadence-$weights.json
  kill $server; wait $server || true
done
serve_llama
.venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8124/v1 "${rate[@]}" \
  --label=llama-server --extra_body='{"cache_prompt": false}' --out=$out/rate-llama-server.json
kill $server; wait $server || true

if [ -n "${MIXED:-}" ]; then
  load=(--chat_concurrency=4 --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05
        --doc_prompt=2000,3000 --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1)
  serve_cadence auto
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 "${load[@]}" --out_dir=$out/mixed-cadence > $out/mixed-cadence.log 2>&1
  kill $server; wait $server || true
  serve_llama
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8124/v1 "${load[@]}" \
    --extra_body='{"cache_prompt": false}' --out_dir=$out/mixed-llama-server > $out/mixed-llama-server.log 2>&1
  kill $server; wait $server || true
fi
