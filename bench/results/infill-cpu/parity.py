"""Fill in the middle on a real code model: cadence-serve against llama-server, request by request.

    python bench/results/infill-cpu/parity.py --llama_server=<llama-server> --model=qwen.gguf \\
        --out=bench/results/infill-cpu/parity.json

Both servers load the same GGUF (Qwen2.5-Coder-0.5B-Instruct Q4_K_M). Each case goes to both
`/infill`s, greedy, with the answer's token ids (`return_tokens`): the prompts' lengths
(`tokens_evaluated`) and the answers' tokens are compared. Then each case's prefix and suffix go
to cadence's `/v1/completions` as `prompt` and `suffix`, and the same prompt, as token ids
(`<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, tokenized by llama-server's
/tokenize), to llama-server's `/completion`. Last, each case's prefix goes as the same
`/completion` request (n_probs 3) to both servers, llama-server's own endpoint on each: their
tokens and log-probabilities are compared. llama-server runs with a float32 KV cache and no flash
attention (its CPU flash attention rounds through float16), as cadence computes.

Where two answers part, both servers are asked again for the same prompt ids (cadence's
`checkpoints.fim` layout), greedy with their top two log-probabilities, and the gap between the
two at the first differing position is reported: a near tie that the two engines' arithmetic
(llama.cpp multiplies K-quant weights by activations it rounds to 8 bits; cadence, by default,
by float32 ones) can tip either way.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import httpx
from absl import app, flags

from cadence.bench.cadence_server import serving

LLAMA = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
MODEL = flags.DEFINE_string("model", None, "a code model's GGUF with infill tokens", required=True)
OUT = flags.DEFINE_string("out", None, "where to write the comparison (JSON)", required=True)
TOKENS = flags.DEFINE_integer("tokens", 48, "greedy tokens per case")

UTIL = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"
CASES = [
    {"input_prefix": "def fib(n):\n    ", "input_suffix": "\n\nprint(fib(10))\n"},
    {"input_prefix": "import json\n\ndef load(path):\n    with open(path) as f:\n        ",
     "input_suffix": "\n    return data\n"},
    {"input_prefix": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
     "input_suffix": "\n    def pop(self):\n        return self.items.pop()\n", "prompt": "        "},
    {"input_prefix": "from util import clamp\n\ndef brightness(v):\n    ",
     "input_suffix": "\n", "input_extra": [{"filename": "util.py", "text": UTIL}]},
    {"input_prefix": "# Sort a list of (name, age) pairs by age, then name.\ndef sort_people(people):\n",
     "input_suffix": "\n\nassert sort_people([('b', 2), ('a', 2)]) == [('a', 2), ('b', 2)]\n",
     "input_extra": [{"filename": "README.md", "text": "People are (name, age) tuples.\n"},
                     {"filename": "models.py", "text": "Person = tuple[str, int]\n"}]},
    {"input_prefix": 'SQL = """\nSELECT name, COUNT(*)\nFROM orders\n',
     "input_suffix": '\nORDER BY 2 DESC\n"""\n'},
]


def llama_server() -> list[str]:
    return [LLAMA.value, "-m", MODEL.value, "--port", "8931", "-c", "4096", "-np", "1", "-t", "2",
            "-ctk", "f32", "-ctv", "f32", "-fa", "off"]


def cadence_serve() -> tuple[list[str], dict]:
    env = dict(os.environ, CADENCE_CACHE=tempfile.mkdtemp(prefix="cadence-infill-"))
    return [sys.executable, "-m", "cadence.server.serve_cli", f"--model={MODEL.value}", "--port=8932",
            "--num_slots=2", "--max_seq_len=2048", "--served_model_name=m"], env


def completion(base: str, case: dict) -> dict:
    """The same llama-server /completion request on either server: the case's prefix, greedy,
    with its top 3 log-probabilities."""
    r = httpx.post(f"{base}/completion", timeout=300, json={
        "prompt": case["input_prefix"], "n_predict": TOKENS.value, "temperature": 0, "n_probs": 3,
        "return_tokens": True, "cache_prompt": False})
    r.raise_for_status()
    j = r.json()
    return {"prompt_tokens": j["tokens_evaluated"], "tokens": j["tokens"], "content": j["content"],
            "top": [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in j["completion_probabilities"]]}


def infill(base: str, case: dict) -> dict:
    r = httpx.post(f"{base}/infill", timeout=300, json={
        **case, "n_predict": TOKENS.value, "temperature": 0, "return_tokens": True,
        "cache_prompt": False})
    r.raise_for_status()
    j = r.json()
    return {"prompt_tokens": j["tokens_evaluated"], "tokens": j["tokens"], "content": j["content"],
            "stop_type": j["stop_type"]}


def llama_cpp() -> tuple[list[dict], list[dict], list[dict]]:
    with serving(llama_server(), 8931) as base:
        fills = [infill(base, case) for case in CASES]
        native = [completion(base, case) for case in CASES]
        plain = []
        for case in CASES:
            def ids(text: str, special: bool = False) -> list[int]:
                return httpx.post(f"{base}/tokenize", json={"content": text, "parse_special": special},
                                  timeout=60).json()["tokens"]

            pre, suf, mid = (ids(t, True)[0] for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
            prompt = [pre, *ids(case["input_prefix"]), suf, *ids(case["input_suffix"]), mid]
            r = httpx.post(f"{base}/completion", timeout=300, json={
                "prompt": prompt, "n_predict": TOKENS.value, "temperature": 0,
                "cache_prompt": False, "return_tokens": True}).json()
            plain.append({"prompt_tokens": r["tokens_evaluated"], "tokens": r["tokens"],
                          "content": r["content"]})
    return fills, plain, native


def cadence() -> tuple[list[dict], list[dict], list[dict]]:
    command, env = cadence_serve()
    with serving(command, 8932, env) as base:
        fills = [infill(base, case) for case in CASES]
        native = [completion(base, case) for case in CASES]
        plain = []
        for case in CASES:
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "prompt": case["input_prefix"], "suffix": case["input_suffix"],
                "max_tokens": TOKENS.value, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}).json()
            choice = r["choices"][0]
            plain.append({"prompt_tokens": r["usage"]["prompt_tokens"], "content": choice["text"],
                          "tokens": [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]})
    return fills, plain, native


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prompt_ids(door: str, case: dict) -> list[int]:
    """The prompt both servers built for `case` at `door`, built here by cadence's code."""
    from cadence.checkpoints import fim
    from cadence.checkpoints.gguf_file import read_gguf
    from cadence.checkpoints.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_fields(read_gguf(MODEL.value)[0])
    extra = (tuple(fim.ExtraFile(f["text"], f.get("filename", "tmp")) for f in case.get("input_extra", ()))
             if door == "/infill" else None)
    hole = fim.Hole(case["input_suffix"], case.get("prompt", "") if extra is not None else "", extra)
    return fim.infill_ids(tok, fim.FimTokens.of(tok), case["input_prefix"], hole)


def gaps(ids: list[int], at: int) -> dict[str, float]:
    """Each server's top-two log-probability gap at output position `at` of `ids`' greedy answer."""
    out = {}
    with serving(llama_server(), 8931) as base:
        r = httpx.post(f"{base}/completion", timeout=300, json={
            "prompt": ids, "n_predict": at + 1, "temperature": 0, "n_probs": 2, "cache_prompt": False}).json()
        top = r["completion_probabilities"][at]["top_logprobs"]
        out["llama_server"] = top[0]["logprob"] - top[1]["logprob"]
    command, env = cadence_serve()
    with serving(command, 8932, env) as base:
        r = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "prompt": ids, "max_tokens": at + 1, "temperature": 0, "logprobs": 2}).json()
        top = sorted(r["choices"][0]["logprobs"]["top_logprobs"][at].values(), reverse=True)
        out["cadence"] = top[0] - top[1]
    return out


def main(argv: list[str]) -> None:
    del argv
    ours, theirs = cadence(), llama_cpp()
    rows = []
    for door, mine, other in (("/infill", ours[0], theirs[0]),
                              ("suffix vs /completion", ours[1], theirs[1]),
                              ("/completion", ours[2], theirs[2])):
        for i, (a, b) in enumerate(zip(mine, other)):
            rows.append({"door": door, "case": i, "prompt_tokens": [a["prompt_tokens"], b["prompt_tokens"]],
                         "tokens": [len(a["tokens"]), len(b["tokens"])],
                         "agree_for": agree(a["tokens"], b["tokens"]),
                         "same": a["tokens"] == b["tokens"], "cadence": a["content"],
                         "llama_server": b["content"]})
            if "top" in a:  # the largest logprob difference over both top-3s, while they agree
                rows[-1]["max_logprob_diff"] = max(
                    abs(x[t] - y[t]) for x, y in zip(a["top"][:rows[-1]["agree_for"] + 1],
                                                     b["top"][:rows[-1]["agree_for"] + 1])
                    for t in x.keys() & y.keys())
            print(f"{door:22} case {i}: prompt {a['prompt_tokens']} / {b['prompt_tokens']} tokens, "
                  f"answers agree for {rows[-1]['agree_for']} of {len(a['tokens'])} / {len(b['tokens'])}")
    for row in rows:
        if not row["same"]:
            at = row["agree_for"]
            if row["door"] == "/completion":  # both sent their top 3: the gaps are there
                tops = {name: sorted(run[2][row["case"]]["top"][at].values(), reverse=True)
                        for name, run in (("cadence", ours), ("llama_server", theirs))}
                row["top2_gap_where_they_part"] = {k: v[0] - v[1] for k, v in tops.items()}
            else:
                row["top2_gap_where_they_part"] = gaps(prompt_ids(row["door"], CASES[row["case"]]), at)
            print(f"{row['door']:22} case {row['case']} parts at token {row['agree_for']}: top-2 "
                  f"log-probability gap {row['top2_gap_where_they_part']}")
    Path(OUT.value).write_text(json.dumps({"model": Path(MODEL.value).name, "greedy_tokens": TOKENS.value,
                                           "cases": CASES, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    app.run(main)
