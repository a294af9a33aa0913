"""Per workload: the median per-stream decode rate and aggregate with speculation off and on
(over the alternating rounds `run.sh` wrote), their ratio, and the tokens per verify step."""

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

print("| workload | streams | off: stream tok/s | ngram: stream tok/s | ratio | off: aggregate | "
      "ngram: aggregate | ratio | tokens per verify step | rounds |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name, modes in rounds.items():
    off, on = modes["off"], modes["ngram"]
    stream = {m: statistics.median(s["median_stream_decode_tok_s"] for s in modes[m]) for m in modes}
    total = {m: statistics.median(s["median_aggregate_tok_s"] for s in modes[m]) for m in modes}
    spec = [s["speculation"] for s in on if s.get("speculation")]
    drafts = sum(s["drafts"] for s in spec)
    per_verify = f"{1 + sum(s['accepted_tokens'] for s in spec) / drafts:.2f} ({drafts:.0f} drafts)" if drafts else "no drafts"
    print(f"| {name} | {off[0]['streams']} | {stream['off']:.1f} | {stream['ngram']:.1f} | "
          f"{stream['ngram'] / stream['off']:.2f}x | {total['off']:.1f} | {total['ngram']:.1f} | "
          f"{total['ngram'] / total['off']:.2f}x | {per_verify} | {len(off)} + {len(on)} |")
