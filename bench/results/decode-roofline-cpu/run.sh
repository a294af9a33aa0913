#!/usr/bin/env bash
# The decode step before and after this round of issue 14 (the kernels' prefetch, fused q/k/v and
# gate/up calls, RoPE looked up in a table), in one session, alternating, with the same bench (the
# new engine_bench, which holds each point to the memory bandwidth probed between its dispatches);
# then served decode iterations against the engine alone, and the host ceiling.
# It ran before the modules moved under `cadence.` (issue 23): at those commits `bench.engine_bench`
# was a top-level module, so the script reproduces them only from a checkout of that time.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=bench/results/decode-roofline-cpu
before=${BEFORE:-2934dce}  # the last commit before this round
tree=/tmp/cadence-$before
[ -d $tree ] || git worktree add -f $tree $before > /dev/null
cp bench/engine_bench.py bench/roofline.py $tree/bench/
engine=(--slots=1,8 --contexts=128,1024 --prompt_tokens=512 --steps=30 --attention=cpu --decode_matmul=cpu)
for run in 1 2 3; do
  (cd $tree && "$OLDPWD"/.venv/bin/python -m bench.engine_bench "${engine[@]}" \
    --out="$OLDPWD"/$out/engine-before-$run.json > "$OLDPWD"/$out/engine-before-$run.txt 2>/dev/null)
  .venv/bin/python -m bench.engine_bench "${engine[@]}" --out=$out/engine-after-$run.json \
    > $out/engine-after-$run.txt 2>/dev/null
done
.venv/bin/python -m bench.engine_bench "${engine[@]}" --weights=int8 --out=$out/engine-after-int8.json \
  > $out/engine-after-int8.txt 2>/dev/null
grep -H -E '^(decode|prefill)' $out/engine-*.txt
