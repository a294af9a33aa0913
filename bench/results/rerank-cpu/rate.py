"""How fast each server reranks: one query against many documents, on a reranker of Qwen3-0.6B's
body.

    python bench/results/rerank-cpu/rate.py --llama_server=<llama-server> \
        --tokenizer_from=<SmolLM2's GGUF> --out=bench/results/rerank-cpu/rate.json

The file is Qwen3-0.6B's shape (28 layers, 16 query and 8 KV heads of 128, a 1024-wide stream,
tied embeddings) as random blocks in llama.cpp's Q4_K_M mix (`cadence.bench.random_gguf`), with
SmolLM2's 49,152-token vocabulary in place of Qwen's (reranking never computes the LM head, so
the vocabulary costs only its embedding rows) and a reranker's head and template as
`parity.py` writes them. Each round sends one /v1/rerank of `--documents` documents (each a
different ~100-token passage of docs/architecture.md) for a query of its own (the query with
the round's number), after a warm-up request; the time is
the client's, from sending to the whole answer. llama-server: `--reranking`, 4 parallel
sequences of 2,048 tokens, a batch that holds any pair whole, 2 threads; cadence-serve: its
defaults, then `--cpu_activations=int8`. One server at a time. Each run's scores are compared
with llama-server's (the random model's scores lie close together, so near ties may swap).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
from absl import app, flags

from cadence.bench.cadence_server import serving
from cadence.bench.random_gguf import SHAPES, copy_tokenizer, write_random_gguf

sys.path.insert(0, str(Path(__file__).parent))
from texts import QUERY, TEMPLATE  # noqa: E402

LLAMA_SERVER = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
TOKENIZER = flags.DEFINE_string("tokenizer_from", None, "SmolLM2's GGUF (its tokenizer)", required=True)
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)
DOCUMENTS = flags.DEFINE_integer("documents", 64, "documents per request")
ROUNDS = flags.DEFINE_integer("rounds", 3, "timed requests per server")


def write_reranker(path: Path) -> None:
    reader = gguf.GGUFReader(TOKENIZER.value)
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    arch, config = SHAPES["qwen3-0.6b"]
    config = dataclasses.replace(config, vocab_size=len(tokens), name="qwen3-0.6b-reranker")
    rows = np.random.default_rng(1).normal(0, 0.05, (2, config.hidden_size)).astype(np.float32)

    def keys(w: gguf.GGUFWriter) -> None:
        copy_tokenizer(TOKENIZER.value)(w)
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": TEMPLATE}])
        w.add_tensor("cls.output.weight", rows)
    write_random_gguf(path, config, arch, metadata=keys)


def documents() -> list[str]:
    text = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    return [text[i * 450:(i + 1) * 450] for i in range(DOCUMENTS.value)]


def timed(base: str, docs: list[str]) -> dict:
    httpx.post(f"{base}/v1/rerank", json={"model": "m", "query": "warm-up", "documents": docs[:4]},
               timeout=600).raise_for_status()
    rounds = []
    for k in range(ROUNDS.value):
        # (a query of its own each round: no pair is one an earlier round computed)
        body = {"model": "m", "query": f"{QUERY} (round {k + 1})", "documents": docs}
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/rerank", json=body, timeout=1200)
        r.raise_for_status()
        seconds = time.perf_counter() - start
        tokens = r.json()["usage"]["prompt_tokens"]
        rounds.append({"seconds": round(seconds, 3), "prompt_tokens": tokens,
                       "documents_per_s": round(len(docs) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1)})
        print(f"  {seconds:.2f} s: {len(docs) / seconds:.2f} documents/s, {tokens / seconds:.0f} tokens/s")
    results = r.json()["results"]
    return {"rounds": rounds, "order": [x["index"] for x in results],
            "scores": {x["index"]: x["relevance_score"] for x in results}}


def main(argv: list[str]) -> None:
    del argv
    path = Path(tempfile.mkdtemp(prefix="rerank-rate-")) / "qwen3-0.6b-reranker.gguf"
    write_reranker(path)
    docs = documents()
    print("llama-server")
    with serving([LLAMA_SERVER.value, "-m", str(path), "--port", "8951", "--reranking", "-c", "8192",
                  "-b", "2048", "-ub", "2048", "-np", "4", "-t", "2"], 8951) as base:
        theirs = timed(base, docs)
    runs = {"llama_server": theirs}
    for name, extra in (("cadence", []), ("cadence_int8_activations", ["--cpu_activations=int8"])):
        print(name)
        env = dict(os.environ, CADENCE_CACHE=tempfile.mkdtemp(prefix="cadence-rerank-"))
        with serving([sys.executable, "-m", "cadence.server.serve_cli", f"--model={path}", "--port=8952",
                      "--served_model_name=m", *extra], 8952, env) as base:
            ours = runs[name] = timed(base, docs)
        ours["max_abs_difference"] = max(abs(theirs["scores"][i] - ours["scores"][i]) for i in theirs["scores"])
        print(f"  against llama-server: largest |score difference| {ours['max_abs_difference']:.2e}, "
              f"the same order: {theirs['order'] == ours['order']}")
    Path(OUT.value).write_text(json.dumps({"documents": len(docs), **runs}, indent=1) + "\n")

if __name__ == "__main__":
    app.run(main)
