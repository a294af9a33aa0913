#!/usr/bin/env bash
# Structured output's cost on the default model (SmolLM2-135M-Instruct, its own Q4_1 blocks on the
# CPU kernels, as cadence-serve runs it), on this machine's cores:
# 1. host side: compiling each grammar, and filling one token's bitmask (structured_bench.py, beside this script);
# 2. served: the per-token time of 8 streams at once, all free (ignore_eos), all with a schema
#    whose answer runs past max_tokens (30 records), and 4 + 4; rounds of the three alternate,
#    twice over (bench/decode_rate.py --constrained). Client and server share the cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-bench/results/structured-cpu}; mkdir -p $out
.venv/bin/python bench/results/structured-cpu/structured_bench.py --out=$out/host.json | tee $out/host.txt

.venv/bin/cadence-serve --port=8123 --num_slots=8 --max_seq_len=4096 --prefill_chunk=128 \
  > $out/serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8123/health > /dev/null; do sleep 2; done
body=$(.venv/bin/python -c 'import json; import sys; sys.path.insert(0, "bench/results/structured-cpu"); from structured_bench import PEOPLE
print(json.dumps({"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}}))')
rate=(--base_url=http://127.0.0.1:8123/v1 --concurrency=8 --rounds=${ROUNDS:-4} --max_tokens=256
      --prompt="List thirty people as JSON, each with a name, age, city, membership and role.")
for pass in 1 2; do
  .venv/bin/python -m cadence.bench.decode_rate "${rate[@]}" --label=free --out=$out/free-$pass.json
  .venv/bin/python -m cadence.bench.decode_rate "${rate[@]}" --constrained="$body" \
    --label=constrained --out=$out/constrained-$pass.json
  .venv/bin/python -m cadence.bench.decode_rate "${rate[@]}" --constrained="$body" \
    --constrained_streams=4 --label=mixed --out=$out/mixed-$pass.json
done | tee $out/served.txt
