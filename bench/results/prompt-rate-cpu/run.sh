#!/usr/bin/env bash
# Prompt rate (prefill) as a client sees it: one stream of a long prompt and 4 output tokens, its
# prompt tokens over its time to first token (bench/decode_rate.py), on cadence's defaults and on
# llama.cpp's llama-server, the same GGUF, one server at a time on the same 2 cores, neither
# reusing a cached prompt. MODEL: the GGUF (SERVED_NAME: the name cadence serves it as, qwen); LLAMA_SERVER: the llama-server binary
# (bench/results/llama-server-cpu/README.md says how it was built). Run from the repository root.
set -euo pipefail
out=${OUT:-bench/results/prompt-rate-cpu}; mkdir -p $out
prompt=$(mktemp); server=
trap 'rm -f $prompt; [ -z "$server" ] || kill $server 2>/dev/null || true' EXIT
# A document and a question about it: the first 8,000 characters of docs/architecture.md.
{ head -c 8000 docs/architecture.md; printf '\n\nSummarize the document above in one line.'; } > $prompt
rate=(--model=${SERVED_NAME:-qwen} --concurrency=1 --rounds=${ROUNDS:-5} --max_tokens=4 --prompt_file=$prompt)

.venv/bin/cadence-serve --model=$MODEL --port=8123 --noprefix_caching ${FLAGS:-} > $out/serve-cadence.log 2>&1 &
server=$!
until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; kill -0 $server || exit 1; done
.venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8123/v1 "${rate[@]}" \
  --label=cadence --out=$out/rate-cadence.json
kill $server; wait $server || true; server=

"$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port 8124 -np 8 -c 32768 -t 2 -tb 2 > $out/serve-llama.log 2>&1 &
server=$!
until curl -sf http://127.0.0.1:8124/health > /dev/null; do sleep 2; kill -0 $server || exit 1; done
.venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8124/v1 "${rate[@]}" \
  --label=llama-server --extra_body='{"cache_prompt": false}' --out=$out/rate-llama-server.json
kill $server; wait $server || true; server=
