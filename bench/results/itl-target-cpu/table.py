"""One row per run of run.sh: python bench/results/itl-target-cpu/table.py round-*/*/run.json"""

import json
import sys

print("| run | chat ITL p50 / p99 / max | server ITL p99 / max | chat TTFT p50 / p99 | doc TTFT p50 | output tok/s |")
print("| --- | --- | --- | --- | --- | --- |")
for path in sys.argv[1:]:
    s = json.load(open(path))["summary"]
    itl, server = s["chat_inter_token_s"], s["server"]["chat_inter_token_server_s"]
    chat, doc = s["classes"]["chat"]["ttft_s"], s["classes"]["document"]["ttft_s"]
    name = "/".join(path.split("/")[-3:-1])
    print(f"| {name} | {itl['p50']:.3f} / {itl['p99']:.3f} / {itl['max']:.3f} s | {server['p99']:.3f} / "
          f"{server['max']:.3f} s | {chat['p50']:.2f} / {chat['p99']:.2f} s | {doc['p50']:.1f} s | "
          f"{s['throughput']['tokens_per_s']:.1f} |")
