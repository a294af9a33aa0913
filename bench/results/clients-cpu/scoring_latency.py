"""echo+logprobs scoring of a 2-token prompt against a plain 1-token completion (issue 40 item 5).

Stdlib only. One warm-up of each (the scoring program compiles on first use), then the two kinds
alternate, 10 requests each, one at a time; medians of the client-side wall time."""
import json
import statistics
import sys
import time
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10


def post(body):
    req = urllib.request.Request(BASE + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


tok = json.loads(urllib.request.urlopen(urllib.request.Request(
    BASE + "/tokenize", data=json.dumps({"model": "smollm2", "prompt": "Hello world",
                                         "add_special_tokens": False}).encode(),
    headers={"Content-Type": "application/json"})).read())
print("prompt 'Hello world' tokens:", tok)
plain = {"model": "smollm2", "prompt": "Hello world", "max_tokens": 1, "temperature": 0}
score = dict(plain, echo=True, logprobs=1)
kinds = {"plain 1-token completion": plain, "echo+logprobs=1, max_tokens=1": score}
for name, body in kinds.items():
    dt, out = post(body)
    print(f"warm-up {name}: {dt:.3f} s; usage {out['usage']}")
    if body.get("echo"):
        print("  echoed logprobs:", json.dumps(out["choices"][0]["logprobs"])[:400])
times = {k: [] for k in kinds}
for _ in range(N):
    for name, body in kinds.items():
        times[name].append(post(body)[0])
res = {}
for name, ts in times.items():
    res[name] = {"median_s": round(statistics.median(ts), 4), "min_s": round(min(ts), 4),
                 "max_s": round(max(ts), 4), "all_s": [round(t, 4) for t in ts]}
    print(f"{name:32s} median {statistics.median(ts) * 1000:7.1f} ms  min {min(ts) * 1000:7.1f}"
          f"  max {max(ts) * 1000:7.1f}")
a, b = (res[k]["median_s"] for k in kinds)
print(f"ratio scoring / plain: {b / a:.2f}x")
print(json.dumps(res))
