#!/usr/bin/env bash
# Speculative decoding (prompt lookup) against plain decoding, served, on the default model.
# Both servers run side by side (one idle while the other is measured) and the rounds
# alternate between them, so drift in the machine's speed falls on both alike; the client
# runs on the same cores. The commands behind README.md here.
#   OUT: where results go; SERVE_FLAGS: cadence-serve's flags (the model included);
#   MODEL: the served name requests use; WORKLOADS: which of those below, in order;
#   REPEATS: rounds per workload and server; MODES, DRAFT_MODEL: the servers (servers.sh).
#   ../speculative-qwen-cpu/run.sh and ../draft-cpu/run.sh set them.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/speculative-cpu}
prompts=bench/results/speculative-cpu/prompts
repeats=${REPEATS:-4}
source bench/results/speculative-cpu/servers.sh
start_servers ${SERVE_FLAGS:---num_slots=8 --max_seq_len=4096 --prefill_chunk=256}
rm -rf $out/rounds && mkdir -p $out/rounds
: > $out/rates.txt
workload() {  # name, then decode_rate's flags
  local name=$1; shift
  for i in $(seq 1 $repeats); do
    for mode in $modes; do
      .venv/bin/python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:$(port_of $mode)/v1 \
        --model=${MODEL:-smollm2-135m} --rounds=1 --max_tokens=200 --label=$mode-$name \
        --out=$out/rounds/$name-$mode-$i.json "$@" 2>&1 | grep -v "^  free" | tee -a $out/rates.txt
    done
  done
}
t07='{"temperature": 0.7, "seed": 1}'
for name in ${WORKLOADS:-quote-t0 quote-t07 code-t0 prose-t0 prose-t07 prose-8}; do
  case $name in
    quote-t0) workload $name --prompt_file=$prompts/quote.txt --concurrency=1 ;;
    quote-t07) workload $name --prompt_file=$prompts/quote.txt --concurrency=1 --extra_body="$t07" ;;
    code-t0) workload $name --prompt_file=$prompts/code.txt --concurrency=1 ;;
    code-t07) workload $name --prompt_file=$prompts/code.txt --concurrency=1 --extra_body="$t07" ;;
    prose-t0) workload $name --concurrency=1 ;;
    prose-t07) workload $name --concurrency=1 --extra_body="$t07" ;;
    prose-8) workload $name --concurrency=8 ;;
  esac
done
.venv/bin/python bench/results/speculative-cpu/summarize.py $out/rounds | tee $out/summary.txt
