#!/usr/bin/env bash
# The prompt rate, loop against unrolled, alternating (../prompt-rate-cpu/run.sh's prompt and
# client, cadence only). Run from the checkout with qwen.gguf in it.
set -uo pipefail
prompt=$(mktemp)
{ head -c 8000 docs/architecture.md; printf '\n\nSummarize the document above in one line.'; } > $prompt
for label in loop unrolled loop unrolled; do
  extra=$([ $label = unrolled ] && echo --nolayer_loop)
  .venv/bin/cadence-serve --model=qwen.gguf --port=8123 --noprefix_caching $extra > /dev/null 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
  .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8123/v1 --model=qwen \
    --concurrency=1 --rounds=5 --max_tokens=4 --prompt_file=$prompt --label=$label | grep "stream(s)"
  kill $server; wait $server
done
rm -f $prompt
