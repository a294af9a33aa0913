"""cadence's LoRA against llama.cpp's: one GGUF adapter on one GGUF model, the same greedy tokens
and log-probabilities at each scale.

    python bench/results/lora-cpu/parity.py --llama_server=<llama-server> \
        --tokenizer_from=<a Qwen2.5 GGUF> --out=bench/results/lora-cpu/parity.json

No adapter can be fetched here, so both files are random and float32 (as in
`../qwen3-cpu/parity.py`, whose model writer, prompts and comparison this reuses): a Llama of 8
layers, 4 query heads of 64 over a 256-wide stream, 2 KV heads, q/k rows permuted as llama.cpp's
converter permutes them, Qwen2.5's tokenizer; and an adapter of rank 8, alpha 16, on all seven
projections of every layer, written as llama.cpp's convert_lora_to_gguf.py writes one (its
lora_b q/k rows permuted too). llama-server loads it with `--lora`, cadence-serve with
`--lora=a=...`; each prompt goes to both servers' /completion (llama-server's shape, which
cadence serves too) with `"lora": [{"id": 0, "scale": s}]` for s in 0 (the base model), 1 and
0.5. The control: cadence at scale 0 against llama.cpp at scale 1, which must not agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
from absl import app

sys.path.insert(0, str(Path(__file__).parents[1] / "qwen3-cpu"))
import parity as base  # noqa: E402  (its flags: --llama_server, --tokenizer_from, --out, --max_tokens)
from prompts import PROMPTS  # noqa: E402

from cadence.bench.cadence_server import serving  # noqa: E402
from cadence.bench.random_gguf import write_gguf_adapter  # noqa: E402
from cadence.model import lora  # noqa: E402

CONFIG = dataclasses.replace(base.SMOLLM3, name="lora-parity", no_rope_layers=())
RANK, ALPHA, SCALES = 8, 16.0, (0.0, 1.0, 0.5)


def random_adapter() -> lora.LoraAdapter:
    """Matrices whose product moves a projection's output by about a tenth of its own."""
    rng = np.random.default_rng(1)
    weights = {}
    for layer in range(CONFIG.num_layers):
        for proj in lora.PROJECTIONS:
            n_in, n_out = lora.projection_shape(CONFIG, proj)
            weights[(layer, proj)] = (rng.normal(0, 0.05, (n_in, RANK)).astype(np.float32),
                                      rng.normal(0, 0.05, (RANK, n_out)).astype(np.float32))
    return lora.LoraAdapter("a", RANK, weights)


def ask(url: str, prompts: list[list[int]], scale: float) -> list[dict]:
    out = []
    for ids in prompts:
        r = httpx.post(f"{url}/completion", timeout=120, json={
            "prompt": ids, "n_predict": base.TOKENS.value, "temperature": 0, "n_probs": 5,
            "cache_prompt": False, "return_tokens": True, "lora": [{"id": 0, "scale": scale}]})
        r.raise_for_status()
        body = r.json()
        out.append({"tokens": body["tokens"], "top": [{t["id"]: t["logprob"] for t in p["top_logprobs"]}
                                                      for p in body["completion_probabilities"]]})
    return out


def main(argv: list[str]) -> None:
    del argv
    from cadence.checkpoints.gguf_file import read_gguf
    from cadence.checkpoints.tokenizer import Tokenizer

    folder = Path(tempfile.mkdtemp(prefix="lora-parity-"))
    model, adapter = folder / "model.gguf", folder / "adapter.gguf"
    base.write_model(model, CONFIG, "llama")
    write_gguf_adapter(adapter, CONFIG, random_adapter(), ALPHA)
    prompts = [Tokenizer.from_gguf_fields(read_gguf(model)[0]).encode(p) for p in PROMPTS]
    with serving([base.FLAGS.value, "-m", str(model), "--lora", str(adapter), "--port", "8931", "-c", "4096",
                  "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off"], 8931) as url:
        theirs = {s: ask(url, prompts, s) for s in SCALES}
    env = dict(os.environ, CADENCE_CACHE=tempfile.mkdtemp(prefix="cadence-parity-"))
    with serving([sys.executable, "-m", "cadence.server.serve_cli", f"--model={model}", "--port=8932",
                  "--num_slots=2", "--max_seq_len=2048", f"--lora=a={adapter}"], 8932, env) as url:
        ours = {s: ask(url, prompts, s) for s in SCALES}
    result = {"config": json.loads(CONFIG.to_json()), "rank": RANK, "alpha": ALPHA}
    for s in SCALES:
        print(f"scale {s}:")
        result[f"scale {s}"] = base.compare(prompts, theirs[s], ours[s])
    print("control: cadence at scale 0 against llama.cpp at scale 1")
    result["control"] = base.compare(prompts, theirs[1.0], ours[0.0])
    Path(base.OUT.value).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
