#!/usr/bin/env bash
# The default model, SmolLM2-135M-Instruct (Q4_1): cadence-serve's decode rates with the
# AVX-512 tiles and with the AVX2 ones (CADENCE_CPU_AVX512=0), then llama-server on the same
# GGUF (LLAMA_SERVER its path), one after another. 1 and 8 streams of 128 tokens, 3 rounds.
set -uo pipefail
here=bench/results/avx512-cpu
gguf=${GGUF:-$HOME/.cache/cadence/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}
rate() {  # $1 label, $2 port
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:$2/v1 --model=smollm2-135m \
    --concurrency=1,8 --rounds=3 --max_tokens=128 --label=$1 --out=$here/smollm2-rate-$1.json \
    ${EXTRA:+--extra_body="$EXTRA"} | grep "stream(s)" | tee -a $here/smollm2-rates.txt
}
for avx512 in 1 0 1 0; do
  CADENCE_CPU_AVX512=$avx512 .venv/bin/cadence-serve --port=8126 > /dev/null 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8126/health > /dev/null; do sleep 1; done
  rate cadence-avx512=$avx512 8126
  kill $server; wait $server
done
$LLAMA_SERVER -m $gguf --port 8001 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
EXTRA='{"cache_prompt": false}' rate llama-server 8001
EXTRA='{"cache_prompt": false}' rate llama-server 8001
kill %1
