#!/usr/bin/env bash
# Sampled decode rates, served: 1 and 8 streams of 128 tokens (`cadence.bench.decode_rate`, 3
# rounds each) under two samplers sent explicitly to every server, temperature 1 over the whole
# vocabulary ("full") and llama.cpp's default chain ("llama": temperature 0.8, top_k 40,
# top_p 0.95, min_p 0.05). One cadence-serve after another (BEFORE: a checkout of the code
# before the sampling kernels, served from there), then llama-server ($LLAMA_SERVER, if set;
# ../llama-server-cpu/README.md builds it), on Qwen2.5-Coder-0.5B Q4_K_M (qwen.gguf in the
# checkout: ../weights-cpu/qwen-q4_k_m/fetch.sh), bfloat16 pool, on an otherwise idle machine.
set -uo pipefail
here=bench/results/sampling-cpu
python=$(realpath -s .venv/bin/python)
model=$(realpath qwen.gguf)
declare -A samplers=(
  [full]='{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}'
  [llama]='{"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}')
rates() {  # label port
  for name in full llama; do
    $python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:$2/v1 --model=qwen \
      --concurrency=1,8 --rounds=3 --max_tokens=128 --label=$1-$name \
      --extra_body="${samplers[$name]}" --out=$here/served-$1-$name.json \
      2>&1 | grep "stream(s)" | tee -a $here/served.txt
  done
}
cadence() {  # label [checkout to serve from: python -m puts the working directory first]
  (cd ${2:-.} && exec $python -m cadence.server.serve_cli --model=$model --port=8125 --num_slots=8 \
    --max_seq_len=4096 --kv_cache_dtype=bfloat16) > ${TMPDIR:-/tmp}/serve-$1.log 2>&1 &
  local pid=$!
  until curl -sf http://127.0.0.1:8125/health > /dev/null; do
    sleep 1; kill -0 $pid 2>/dev/null || { echo "$1: server died"; tail -5 ${TMPDIR:-/tmp}/serve-$1.log; return 1; }
  done
  rates $1 8125
  kill $pid; wait $pid 2>/dev/null
}
for round in ${ROUNDS:-1 2}; do
  [ -n "${BEFORE:-}" ] && cadence before-$round $BEFORE
  cadence after-$round
done
[ -z "${LLAMA_SERVER:-}" ] && exit 0
$LLAMA_SERVER -m qwen.gguf --port 8001 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
for round in ${ROUNDS:-1 2}; do
  rates llama-server-$round 8001
done
kill %1
