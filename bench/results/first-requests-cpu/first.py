"""The first requests after a start: eight short chats, one after another, sent as soon as
/health answers, greedy, 16 tokens each; prints each one's latency (seconds).

    python first.py http://127.0.0.1:8125/v1 <served model name>
"""
import json
import sys
import time
import urllib.request

base, model = sys.argv[1], sys.argv[2]
latencies = []
for i in range(8):
    body = json.dumps({"model": model, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "user", "content": f"Question {i}: what does a lighthouse keeper do all day, and why?"}]}).encode()
    start = time.perf_counter()
    request = urllib.request.Request(f"{base}/chat/completions", body, {"content-type": "application/json"})
    urllib.request.urlopen(request).read()
    latencies.append(time.perf_counter() - start)
print(" ".join(f"{t:.2f}" for t in latencies))
