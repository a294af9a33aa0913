#!/bin/bash
# usage: measure.sh NAME MODEL [extra args...]
set -u
NAME=$1; MODEL=$2; shift 2
cd /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
LOG=/tmp/llama/logs/$NAME.log
OUT=/tmp/llama/logs/$NAME.mem
CMD="build/bin/llama-server -m $MODEL --port 8130 -np 8 -c 32768 -t 2 -tb 2 $*"
echo "CMD: $CMD" > $OUT
$CMD > $LOG 2>&1 &
PID=$!
echo "PID $PID" >> $OUT
T0=$(date +%s.%N)
until curl -sf http://127.0.0.1:8130/health >/dev/null; do
  if ! kill -0 $PID 2>/dev/null; then echo "server died" >> $OUT; exit 1; fi
  sleep 0.2
done
T1=$(date +%s.%N)
echo "ready_after_s $(echo "$T1 - $T0" | bc)" >> $OUT
echo "== after health" >> $OUT
grep -E '^(VmRSS|VmHWM|RssAnon|RssFile):' /proc/$PID/status >> $OUT
curl -s http://127.0.0.1:8130/v1/completions -H 'content-type: application/json' -d '{"prompt":"def quicksort(arr):","max_tokens":128,"temperature":0}' > /tmp/llama/logs/$NAME.resp1.json
curl -s http://127.0.0.1:8130/v1/completions -H 'content-type: application/json' -d '{"prompt":"Write a long story about a cat.","max_tokens":64,"temperature":0.7}' > /tmp/llama/logs/$NAME.resp2.json
sleep 1
echo "== after requests" >> $OUT
grep -E '^(VmRSS|VmHWM|RssAnon|RssFile):' /proc/$PID/status >> $OUT
kill $PID; wait $PID 2>/dev/null
cat $OUT
