"""Per workload: the median per-stream decode rate and aggregate of each speculative mode (over
the alternating rounds `run.sh` wrote), each against `off`, and each drafting mode's tokens per
verify step."""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

rounds = defaultdict(lambda: defaultdict(list))
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    name, mode, _ = path.stem.rsplit("-", 2)
    setting = json.loads(path.read_text())["settings"][0]
    rounds[name][mode].append(setting)

modes = sorted({m for workload in rounds.values() for m in workload}, key=lambda m: (m != "off", m))
drafting = [m for m in modes if m != "off"]
head = ["workload", "streams", *(f"{m}: stream tok/s" for m in modes),
        *(f"{m}/off stream" for m in drafting), *(f"{m}/off aggregate" for m in drafting),
        *(f"{m}: tokens per verify step" for m in drafting), "rounds"]
print("| " + " | ".join(head) + " |")
print("|" + " --- |" * len(head))
for name, runs in rounds.items():
    stream = {m: statistics.median(s["median_stream_decode_tok_s"] for s in runs[m]) for m in runs}
    total = {m: statistics.median(s["median_aggregate_tok_s"] for s in runs[m]) for m in runs}

    def per_verify(mode):
        spec = [s["speculation"] for s in runs[mode] if s.get("speculation")]
        drafts = sum(s["drafts"] for s in spec)
        return f"{1 + sum(s['accepted_tokens'] for s in spec) / drafts:.2f} ({drafts:.0f} drafts)" if drafts else "no drafts"

    row = [name, str(runs["off"][0]["streams"]), *(f"{stream[m]:.1f}" for m in modes),
           *(f"{stream[m] / stream['off']:.2f}x" for m in drafting),
           *(f"{total[m] / total['off']:.2f}x" for m in drafting),
           *(per_verify(m) for m in drafting), " + ".join(str(len(runs[m])) for m in modes)]
    print("| " + " | ".join(row) + " |")
