"""cadence's reranking against llama.cpp's on one reranker GGUF: the same scores, the same order.

    python bench/results/rerank-cpu/parity.py --llama_server=<llama-server> \
        --tokenizer_from=<a GGUF with <|im_start|> and <|im_end|>: SmolLM2's> \
        --out=bench/results/rerank-cpu/parity.json

No reranker's weights can be fetched here, so the file is written as llama.cpp's converter writes
Qwen3-Reranker, over a small Qwen3 of random weights (the model of ../qwen3-cpu/parity.py: 4
layers, 4 query heads of 128 over a 256-wide stream, 2 KV heads, q/k norms, float32, tied
embeddings, the tokenizer of `--tokenizer_from`): pooling type rank, labels yes and no,
`cls.output` the LM head's rows for "yes" and "no", and Qwen3-Reranker's "rerank" template. With
`--gguf`, a real reranker file instead.

One query and eight documents (0 to ~300 tokens of text) go to both servers' /v1/rerank
(llama-server `--reranking`, a float32 KV cache, no flash attention, a batch that holds any pair
whole). The script prints each document's two scores, their largest difference, whether the two
orders agree, and both servers' token counts; a control scores the pairs with cadence's head
applied without the softmax (the head's outputs as they are), which must not agree.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import gguf
import httpx
import jax
import numpy as np
from absl import app, flags

from cadence.bench.cadence_server import serving
from cadence.bench.random_gguf import add_shape, copy_tokenizer
from cadence.model import params as params_lib
from cadence.model.config import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from texts import QUERY, TEMPLATE  # noqa: E402

LLAMA_SERVER = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
TOKENIZER = flags.DEFINE_string("tokenizer_from", None, "a GGUF whose tokenizer to copy")
GGUF = flags.DEFINE_string("gguf", None, "a reranker GGUF to serve instead of the random one")
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)

DOCUMENTS = [
    "",
    "Chunked prefill.",
    "The scheduler splits a long prompt into chunks and runs one beside every decode step.",
    "Bananas are berries, but strawberries are not.",
    "Paged KV: each sequence's keys and values live in fixed-size pages named by a page table.",
    "<|im_end|> is a special token in the template; here it is only text.",
    "The weather in Lisbon is mild in winter. " * 6,
    (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()[:1400],
]


def write_reranker(path: Path, tokenizer_from: str) -> None:
    reader = gguf.GGUFReader(tokenizer_from)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = ModelConfig(name="qwen3-reranker-parity", vocab_size=vocab, hidden_size=256, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=128, ffn_size=768, rms_norm_eps=1e-6,
                         rope_theta=1e6, tie_embeddings=True, qk_norm=True, max_context=4096)
    rng = np.random.default_rng(0)
    params = params_lib.random_params(config, jax.random.key(0))
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_shape(w, config)
    w.add_name(config.name)
    copy_tokenizer(tokenizer_from)(w)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    w.add_chat_template([{"name": "rerank", "template": TEMPLATE}])
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    embedding = np.asarray(params["embed"]["embedding"], np.float32)
    # (as the converter takes them: the tied head's rows for "yes" and "no"; 4x, so that the
    # scores spread beyond a random model's near-even odds)
    w.add_tensor("cls.output.weight", 4 * np.ascontiguousarray(embedding[[tokens.index("yes"), tokens.index("no")]]))
    for spec in params_lib.param_specs(config):
        array = np.asarray(params_lib.get(params, spec.path), np.float32)
        if spec.path[-1] == "scale":
            array = (1 + 0.3 * rng.standard_normal(array.shape)).astype(np.float32)
        w.add_tensor(spec.gguf_name, np.ascontiguousarray(array.T if spec.transpose else array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rerank(base: str) -> dict:
    r = httpx.post(f"{base}/v1/rerank", timeout=600, json={
        "model": "m", "query": QUERY, "documents": DOCUMENTS, "top_n": len(DOCUMENTS)})
    r.raise_for_status()
    body = r.json()
    return {"scores": {x["index"]: x["relevance_score"] for x in body["results"]},
            "order": [x["index"] for x in body["results"]], "tokens": body["usage"]["prompt_tokens"]}


def llama_cpp(path: Path) -> dict:
    with serving([LLAMA_SERVER.value, "-m", str(path), "--port", "8941", "--reranking", "-c", "4096",
                  "-b", "4096", "-ub", "4096", "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32",
                  "-fa", "off"], 8941) as base:
        return rerank(base)


def cadence(path: Path) -> dict:
    env = dict(os.environ, CADENCE_CACHE=tempfile.mkdtemp(prefix="cadence-rerank-"))
    with serving([sys.executable, "-m", "cadence.server.serve_cli", f"--model={path}", "--port=8942",
                  "--num_slots=2", "--max_seq_len=2048", "--served_model_name=m"], 8942, env) as base:
        return rerank(base)


def main(argv: list[str]) -> None:
    del argv
    from cadence.checkpoints.gguf import load_ranking

    if GGUF.value:
        path = Path(GGUF.value)
    else:
        path = Path(tempfile.mkdtemp(prefix="rerank-parity-")) / "qwen3-reranker.gguf"
        write_reranker(path, TOKENIZER.value)
    theirs, ours = llama_cpp(path), cadence(path)
    diffs = {i: abs(theirs["scores"][i] - ours["scores"][i]) for i in theirs["scores"]}
    for i in sorted(diffs):
        print(f"document {i}: llama.cpp {theirs['scores'][i]:.6f}, cadence {ours['scores'][i]:.6f}, "
              f"|difference| {diffs[i]:.2e}")
    print(f"largest |difference| {max(diffs.values()):.2e}; the same order: {theirs['order'] == ours['order']}; "
          f"prompt tokens: llama.cpp {theirs['tokens']}, cadence {ours['tokens']}")
    # The control: the head's first output without the softmax (logit(yes)), from the scores'
    # own odds: log(p / (1 - p)) = yes - no, which must not be what llama.cpp reports.
    head = load_ranking(path)
    control = {i: float(np.log(p / (1 - p))) for i, p in ours["scores"].items()}
    control_diff = max(abs(theirs["scores"][i] - control[i]) for i in control)
    print(f"control (yes - no, no softmax): largest |difference| {control_diff:.2e}")
    Path(OUT.value).write_text(json.dumps({
        "gguf": path.name, "labels": list(head.labels), "softmax": head.softmax, "query": QUERY,
        "documents": [d[:80] for d in DOCUMENTS], "llama_cpp": theirs, "cadence": ours,
        "max_abs_difference": max(diffs.values()), "same_order": theirs["order"] == ours["order"],
        "control_max_abs_difference": control_diff}, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
