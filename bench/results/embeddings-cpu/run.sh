#!/usr/bin/env bash
# Embeddings on the default model's GGUF, one server at a time on the client's two cores:
# bench.py --chats against cadence with each NAME=FLAGS configuration, then (with LLAMA_SERVER
# set to its binary, LLAMA_FLAGS its extra flags) bench.py against llama-server --embeddings,
# and compare.py of the first cadence run and llama-server's. No configuration given: "default=";
# "none" runs llama-server alone.
#   LLAMA_SERVER=.../llama-server bench/results/embeddings-cpu/run.sh "default=" "target=--itl_target=0.1"
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=bench/results/embeddings-cpu
out=${OUT:-$here/runs}; mkdir -p $out
gguf=${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}
pooling=${POOLING:-last}
wait_healthy() { until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done; }

first=
for config in "${@:-default=}"; do
  [ "$config" = none ] && continue
  name=${config%%=*}; flags=${config#*=}; first=${first:-$name}
  # shellcheck disable=SC2086
  .venv/bin/cadence-serve --port=8123 --model="$gguf" --served_model_name=served --num_slots=8 \
    --max_seq_len=4096 --prefill_chunk=128 --pooling=$pooling $flags > $out/serve-$name.txt 2>&1 &
  server=$!
  wait_healthy
  .venv/bin/python $here/bench.py --url=http://127.0.0.1:8123 --out=$out/$name --chats > $out/$name.txt 2>&1
  kill $server; wait $server || true
done

if [ -n "${LLAMA_SERVER:-}" ]; then
  # shellcheck disable=SC2086
  "$LLAMA_SERVER" -m "$gguf" --port 8123 -t 2 -np 8 -c 8192 --embeddings --pooling $pooling \
    ${LLAMA_FLAGS:-} > $out/serve-llama-server.txt 2>&1 &
  server=$!
  wait_healthy
  .venv/bin/python $here/bench.py --url=http://127.0.0.1:8123 --out=$out/llama-server \
    > $out/llama-server.txt 2>&1
  kill $server; wait $server || true
  if [ -n "$first" ]; then
    .venv/bin/python $here/compare.py $out/$first $out/llama-server | tee $out/compare.txt
  fi
fi
