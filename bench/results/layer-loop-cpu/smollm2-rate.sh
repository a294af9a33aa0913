#!/usr/bin/env bash
# SmolLM2-135M decode rates and resident memory, loop against unrolled, alternating. Run from
# the checkout.

for label in loop unrolled loop unrolled; do
  extra=$([ $label = unrolled ] && echo --nolayer_loop)
  .venv/bin/cadence-serve --port=8126 $extra > /dev/null 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8126/health > /dev/null; do sleep 1; done
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8126/v1 --model=smollm2-135m --concurrency=1,8 --rounds=3 --max_tokens=128 --label=$label 2>&1 | grep "stream(s)"
  echo "$label rss=$(grep VmRSS /proc/$server/status | awk '{printf "%.0f", $2/1024}') MiB"
  kill $server; wait $server
done
