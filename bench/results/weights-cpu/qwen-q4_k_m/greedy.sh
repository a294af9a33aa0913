#!/usr/bin/env bash
# Greedy replies (temperature 0, 96 tokens) of one cadence-serve to four chat prompts, saved as
# greedy-$1.json. Arguments and environment as measure.sh's (WEIGHTS=float for the float path).
set -uo pipefail
label=$1; checkout=$2; cache=$3; weights=${WEIGHTS:-auto}
python=${PYTHON:-.venv/bin/python}; python=$(realpath $python)
out=$(realpath ${OUT:-.}); gguf=$(realpath $GGUF)
cd $checkout
CADENCE_CACHE=$cache $python -m cadence.server.serve_cli --model=$gguf --port=8125 \
  --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 --weights=$weights > $out/serve-greedy-$label.log 2>&1 &
server=$!
until curl -sf http://127.0.0.1:8125/health > /dev/null; do sleep 2; kill -0 $server 2>/dev/null || exit 1; done
$python - "$out/greedy-$label.json" "$(basename $gguf .gguf)" <<'PY'
import json, sys, httpx
prompts = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash map is in two sentences.",
           "Write a bash one-liner that counts the lines of every .py file in a folder.",
           "What is 17 * 23? Answer with the number only."]
out = []
for p in prompts:
    r = httpx.post("http://127.0.0.1:8125/v1/chat/completions", timeout=600, json={
        "model": sys.argv[2], "messages": [{"role": "user", "content": p}],
        "temperature": 0, "max_tokens": 96})
    out.append({"prompt": p, "reply": r.json()["choices"][0]["message"]["content"]})
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
kill $server; wait $server
