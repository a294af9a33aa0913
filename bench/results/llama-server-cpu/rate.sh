#!/usr/bin/env bash
# Decode rate of llama-server (LLAMA_SERVER its path; README.md here builds it) on MODEL, as
# ../layer-loop-cpu/rate.sh measures cadence's: 1 and 8 streams of 128 tokens, 3 rounds each,
# once per round in ROUNDS (default "1 2"), `cache_prompt: false`. -np 8 -c 32768: 8 slots of
# 4096 tokens, 2 threads. Results to OUT (rate-llama-server-<round>.json, rates.txt). Run
# from the checkout.
set -uo pipefail
out=${OUT:?set OUT to the results folder}
$LLAMA_SERVER -m "$MODEL" --port 8001 -np 8 -c 32768 -t 2 -tb 2 > /dev/null 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
for round in ${ROUNDS:-1 2}; do
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8001/v1 --model=qwen \
    --concurrency=1,8 --rounds=3 --max_tokens=128 --label=llama-server-$round \
    --extra_body='{"cache_prompt": false}' --out=$out/rate-llama-server-$round.json \
    | grep "stream(s)" | tee -a $out/rates.txt
done
kill $pid
