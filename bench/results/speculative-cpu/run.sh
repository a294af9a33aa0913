#!/usr/bin/env bash
# Speculative decoding (prompt lookup) against plain decoding, served, on the default model.
# Both servers run side by side (one idle while the other is measured) and the rounds
# alternate between them, so drift in the machine's speed falls on both alike; the client
# runs on the same cores. The commands behind README.md here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/speculative-cpu
prompts=$out/prompts
repeats=${REPEATS:-4}
source $out/servers.sh
start_servers --num_slots=8 --max_seq_len=4096 --prefill_chunk=256
rm -rf $out/rounds && mkdir -p $out/rounds
: > $out/rates.txt
workload() {  # name, then decode_rate's flags
  local name=$1; shift
  for i in $(seq 1 $repeats); do
    for mode in off ngram; do
      .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:$(port_of $mode)/v1 \
        --rounds=1 --max_tokens=200 --label=$mode-$name --out=$out/rounds/$name-$mode-$i.json \
        "$@" 2>&1 | grep -v "^  free" | tee -a $out/rates.txt
    done
  done
}
workload quote-t0 --prompt_file=$prompts/quote.txt --concurrency=1
workload quote-t07 --prompt_file=$prompts/quote.txt --concurrency=1 --extra_body='{"temperature": 0.7, "seed": 1}'
workload code-t0 --prompt_file=$prompts/code.txt --concurrency=1
workload prose-t0 --concurrency=1
workload prose-t07 --concurrency=1 --extra_body='{"temperature": 0.7, "seed": 1}'
workload prose-8 --concurrency=8
.venv/bin/python $out/summarize.py $out/rounds | tee $out/summary.txt
