#!/bin/bash
# Every client driver against a running server on :8011; one results file per run.
# Usage: run_all.sh TAG   (results in /tmp/clients-TAG.jsonl, text in /tmp/clients-TAG.txt)
cd "$(dirname "$0")"
TAG=${1:-run}
export CLIENTS_OUT=/tmp/clients-$TAG.jsonl
rm -f $CLIENTS_OUT
{
/tmp/clients/bin/python openai_calls.py chat tools parse models completions tokenize
/tmp/clients/bin/python libs_calls.py instructor langchain litellm
./llm_calls.sh /tmp/clients/bin/llm
/tmp/c-openai/bin/python openai_calls.py chat tools parse models completions tokenize
/tmp/c-instructor/bin/python libs_calls.py instructor
/tmp/c-langchain-openai/bin/python libs_calls.py langchain
./llm_calls.sh /tmp/c-llm/bin/llm
/tmp/clients/bin/python openai_calls.py responses
/tmp/c-openai/bin/python openai_calls.py responses
} 2>&1 | grep -v "^      server: *$" | grep -v "Give Feedback\|_turn_on_debug\|^$"
