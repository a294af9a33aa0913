#!/usr/bin/env bash
# The mixed load (4 closed-loop chats, a 2-3k-token document every ~20 s, 60 s window) served by
# cadence on the CPU kernels with each configuration in turn: NAME=FLAGS pairs, one server at a
# time on the client's two cores. The load and server settings of ../kernels-cpu/served.sh.
#   bench/results/itl-target-cpu/run.sh "base=" "target=--itl_target=0.2"
# GGUF: serve that file instead of the default model.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/itl-target-cpu/runs}; mkdir -p $out
load=(--chat_concurrency=4 --chat_prompt=50,400 --chat_output=64,128 --doc_rate=0.05
      --doc_prompt=2000,3000 --doc_output=32,128 --warmup=10 --duration=60 --drain_timeout=120 --seed=1)
model=(); named=()
if [ -n "${GGUF:-}" ]; then model=(--model="$GGUF" --served_model_name=served); named=(--model=served); fi
for config in "$@"; do
  name=${config%%=*}; flags=${config#*=}
  # shellcheck disable=SC2086
  .venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 "${model[@]}" $flags \
    > $out/serve-$name.txt 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  .venv/bin/cadence-bench run --base_url=http://127.0.0.1:8123/v1 "${named[@]}" "${load[@]}" \
    --out_dir=$out/$name > $out/$name.txt 2>&1
  kill $server; wait $server || true
done
