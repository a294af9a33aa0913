"""Predicted Outputs (a chat's `prediction`) against prompt lookup alone, one stream, greedy.

    python bench/results/prediction-cpu/run.py --model=<qwen2.5-coder GGUF> \
        --out=bench/results/prediction-cpu/results.json

One cadence-serve (its defaults: speculative decoding by prompt lookup, 3 drafts on the CPU)
answers each workload's chat with and without the prediction, alternating, `--rounds` times:
- code: `../speculative-cpu/prompts/code.txt`, a 25-line function to rewrite with a variable
  renamed; the prediction is the function as it stands, which the prompt holds too;
- license: the MIT license to write out for a named holder; the prediction is its text, which
  the prompt does not hold, so prompt lookup has nothing to draft from until the answer
  repeats itself.
Each answer's decode rate is its completion tokens over the time after its first token
(streamed); the answers with and without the prediction must be the same text.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
from absl import app, flags

from cadence.bench.cadence_server import ServerConfig, spawned

MODEL = flags.DEFINE_string("model", None, "the GGUF to serve", required=True)
OUT = flags.DEFINE_string("out", None, "where the JSON results go", required=True)
ROUNDS = flags.DEFINE_integer("rounds", 3, "answers per workload and mode")

HERE = Path(__file__).parent
FUNCTION = (HERE.parent / "speculative-cpu" / "prompts" / "code.txt").read_text()
MIT = """MIT License

Copyright (c) 2024 Jane Doe

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""
WORKLOADS = {
    "code": (FUNCTION, FUNCTION.split("```python\n")[1].split("```")[0]),
    "license": ("Write out the MIT License for software by Jane Doe, copyright 2024. Output only "
                "the license text.", MIT),
}


def ask(base: str, prompt: str, prediction: str | None) -> dict:
    body = {"model": MODEL.value, "messages": [{"role": "user", "content": prompt}], "max_tokens": 300,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    start, first, text, usage = time.monotonic(), None, [], None
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.monotonic()
                    text.append(choice["delta"]["content"])
    end = time.monotonic()
    tokens = usage["completion_tokens"]
    return {"text": "".join(text), "completion_tokens": tokens, "ttft_s": first - start,
            "decode_tok_s": (tokens - 1) / (end - first),
            "details": usage.get("completion_tokens_details")}


def main(argv: list[str]) -> None:
    del argv
    rows = []
    config = ServerConfig(model=MODEL.value, num_slots=4, max_seq_len=4096)
    with spawned(config, log="/tmp/prediction-serve.log") as base:
        for name, (prompt, prediction) in WORKLOADS.items():
            runs = {"lookup": [], "prediction": []}
            for _ in range(ROUNDS.value):
                runs["lookup"].append(ask(base, prompt, None))
                runs["prediction"].append(ask(base, prompt, prediction))
            texts = {r["text"] for rs in runs.values() for r in rs}
            row = {"workload": name, "same_answer": len(texts) == 1,
                   "completion_tokens": runs["lookup"][0]["completion_tokens"],
                   "details_with_prediction": runs["prediction"][0]["details"]}
            for mode, rs in runs.items():
                row[f"{mode}_decode_tok_s"] = [round(r["decode_tok_s"], 1) for r in rs]
            ratio = statistics.median(row["prediction_decode_tok_s"]) / statistics.median(row["lookup_decode_tok_s"])
            row["ratio_of_medians"] = round(ratio, 2)
            rows.append(row)
            print(f"{name}: {row['completion_tokens']} tokens, same answer {row['same_answer']}; decode "
                  f"tok/s lookup {row['lookup_decode_tok_s']}, with the prediction "
                  f"{row['prediction_decode_tok_s']} ({ratio:.2f}x); prediction tokens "
                  f"{row['details_with_prediction']}")
    Path(OUT.value).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
