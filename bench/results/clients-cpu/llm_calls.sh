#!/bin/bash
# The llm CLI against cadence-serve. Usage: llm_calls.sh /path/to/venv/bin/llm
# Needs extra-openai-models.yaml (beside this script) in $LLM_USER_PATH.
L=${1:-/tmp/clients/bin/llm}
export LLM_USER_PATH=${LLM_USER_PATH:-/tmp/llm-home}
mkdir -p "$LLM_USER_PATH"
cp "$(dirname "$0")/extra-openai-models.yaml" "$LLM_USER_PATH/"
ver=$($L --version)
run() {  # run NAME CMD...: prints OK/FAIL, the seconds, the output's tail
  local name=$1; shift
  local t0=$(date +%s.%N)
  out=$(timeout 300 "$@" 2>&1); rc=$?
  local dt=$(echo "$(date +%s.%N) - $t0" | bc)
  if [ $rc -eq 0 ]; then m="OK "; else m="FAIL"; fi
  printf '[%s] %-12s %-40s %6.2fs rc=%s %s\n' "$m" "$ver" "$name" "$dt" "$rc" "$(echo "$out" | tr '\n' ' ' | cut -c1-400)"
}
run "llm -m smollm2 'hi'" $L -m smollm2 -o max_tokens 32 'hi'
run "llm -m smollm2 --no-stream" $L -m smollm2 --no-stream -o max_tokens 32 'Say hello.'
run "llm -m smollm2 -s system" $L -m smollm2 -s 'Answer briefly.' -o max_tokens 32 'What is 2+2?'
run "llm --schema 'name, age int'" $L -m smollm2 --schema 'name, age int' -o max_tokens 200 'Invent a dog.'
run "llm --schema nested JSON" $L -m smollm2 -o max_tokens 200 --schema '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"address":{"type":"object","properties":{"street":{"type":"string"},"city":{"type":"string"}},"required":["street","city"]}},"required":["name","age","address"]}' 'Alice is 31 and lives at 12 Oak Street, Paris. Record her.'
run "llm --schema-multi 'name, age int'" $L -m smollm2 --schema-multi 'name, age int' -o max_tokens 300 'Invent two dogs.'
run "llm -m smollm2-completion (completions)" $L -m smollm2-completion -o max_tokens 16 'The capital of France is'
run "llm -m smollm2 -o temperature 0 -o seed 1" $L -m smollm2 -o temperature 0 -o seed 1 -o max_tokens 16 'hi'
run "llm logs -n 1 (recorded)" $L logs -n 1 --json
