"""Time to first token of short, different chat messages sent one at a time: the chat
template's own system prompt (and its role tokens) is what they share. 24 messages of 8-40
tokens of English (`bench.workload.text_of`, seeded), each `max_tokens=1`, greedy, not streamed:
a request's latency is its time to first token. Prints each server's median and quartiles over
the last 20 (the first 4 warm the server and its cache) and the prompt tokens it says it reused.

    python bench/results/prefix-tail-cpu/short_chats.py <base_url> <model> [llama]

`llama`: the server is llama-server (its `timings.cache_n` says what it reused).
"""
import sys
import time

import httpx
import numpy as np

from cadence.bench.workload import text_of

base, model = sys.argv[1], sys.argv[2]
llama = sys.argv[3:] == ["llama"]
rng = np.random.default_rng(0)
latency, prompt, cached = [], [], []
for i in range(24):
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": text_of(int(rng.integers(8, 41)), rng)}]}
    start = time.perf_counter()
    r = httpx.post(f"{base}/chat/completions", json=body, timeout=120).json()
    latency.append(time.perf_counter() - start)
    prompt.append(r["usage"]["prompt_tokens"])
    cached.append(r["timings"]["cache_n"] if llama else r["usage"]["prompt_tokens_details"]["cached_tokens"])
lat = np.array(latency[4:]) * 1e3
print(f"{base}: TTFT p25/p50/p75 {np.percentile(lat, 25):.0f}/{np.median(lat):.0f}/{np.percentile(lat, 75):.0f} ms; "
      f"prompt tokens {sum(prompt[4:])}, reused {sum(cached[4:])} (median {np.median(prompt[4:]):.0f} a prompt)")
