#!/usr/bin/env bash
# One prepared run on a fresh GPU machine (docs/gpu.md): installs cadence, then runs
# `python -m cadence.bench.gpu_check`, whose parts each have a timeout of their own (under
# 10 minutes in all). Results: OUT_DIR (default bench/results/gpu-<date>).
#
#   bench/gpu_check.sh [OUT_DIR]
#   bench/gpu_check.sh --dry-run       # any machine: lower every GPU program for CUDA
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--dry-run" ]; then
    exec "$PY" -m cadence.bench.gpu_check --dry_run
fi
OUT=${1:-bench/results/gpu-$(date -u +%F)}
mkdir -p "$OUT"
{
    # Wheels carried in .whl/ (the lent machine reaches no package index): on PYTHONPATH.
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # cadence with CUDA JAX where an index answers; else cadence alone over the JAX installed.
    timeout 180 "$PY" -m pip install -q --retries 0 --timeout 10 -e '.[gpu]' \
        || timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
        || echo "install failed: the parts run from what is importable"
    "$PY" -c "import jax; print('JAX', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/install.log"
export PYTHONPATH=${PYTHONPATH:-}${PYTHONPATH:+:}/tmp/site
"$PY" -m cadence.bench.gpu_check --out_dir="$OUT"
