#!/usr/bin/env bash
# short_chats.py on cadence before and after partial-page prefix hits and on llama-server, for
# SmolLM2-135M-Instruct (Q4_1) and Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, qwen.gguf in the
# checkout: ../weights-cpu/qwen-q4_k_m/fetch.sh), one server at a time, ROUNDS times (default 2).
# BEFORE and LLAMA_SERVER as in run.sh.
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=bench/results/prefix-tail-cpu
python=$(realpath -s .venv/bin/python)
declare -A models=([smollm2]=$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf [qwen]=$(realpath qwen.gguf))

cadence() {  # label model [checkout]
  (cd ${3:-.} && exec $python -m cadence.server.serve_cli --model=${models[$2]} --port=8123 --num_slots=8 \
    --max_seq_len=4096 --served_model_name=$2) > ${TMPDIR:-/tmp}/serve-$1.log 2>&1 &
  local server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do
    sleep 2; kill -0 $server 2>/dev/null || { echo "$1: server died"; tail -5 ${TMPDIR:-/tmp}/serve-$1.log; return 1; }
  done
  echo -n "$1 $2: " | tee -a $here/short_chats.txt
  $python $here/short_chats.py http://127.0.0.1:8123/v1 $2 | tee -a $here/short_chats.txt
  kill $server; wait $server 2>/dev/null
}

llama() {  # model
  "$LLAMA_SERVER" -m ${models[$1]} --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
  local server=$!
  until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; done
  echo -n "llama-server $1: " | tee -a $here/short_chats.txt
  $python $here/short_chats.py http://127.0.0.1:8124/v1 $1 llama | tee -a $here/short_chats.txt
  kill $server; wait $server 2>/dev/null
}

for model in smollm2 qwen; do
  for round in $(seq ${ROUNDS:-2}); do
    [ -n "${BEFORE:-}" ] && cadence before-$round $model $BEFORE
    cadence after-$round $model
    [ -n "${LLAMA_SERVER:-}" ] && llama $model
  done
done
