"""cadence against llama.cpp on one Qwen3 GGUF: the same greedy tokens, the same log-probabilities.

    python bench/results/qwen3-cpu/parity.py --llama_server=<llama-server> \
        --tokenizer_from=<a Qwen2.5 or Qwen3 GGUF> --out=bench/results/qwen3-cpu/parity.json
    python bench/results/qwen3-cpu/parity.py ... --yarn_factor=8 --yarn_original=256 \
        --out=bench/results/yarn-cpu/parity.json
    python bench/results/qwen3-cpu/parity.py ... --arch=smollm3 --out=bench/results/smollm3-cpu/parity.json
    python bench/results/qwen3-cpu/parity.py ... --arch=granite --out=bench/results/granite-cpu/parity.json

With `--arch=smollm3`, the file is a SmolLM3 of the same kind instead: Llama's layers (no q/k
norms, heads of 64, rows permuted as llama.cpp's converter permutes them), 8 of them, of which
llama.cpp leaves layers 3 and 7 unrotated (NoPE); RoPE's base is 10,000, not SmolLM3's 5e6, so
that rotating or not shows within these prompts. A control goes beside it: cadence serving the
same weights as a "llama" file, every layer rotated, which must not agree. With
`--arch=granite`, a Granite of the same kind: Llama's layers (8, heads of 64, rows permuted) with
Granite 3.3 2B's four scalars (embeddings x12, residual branches x0.22, attention scores x1/64,
logits /8), and the same control (the weights as a "llama" file, no scalars). With
`--arch=gemma3` (`--tokenizer_from` a Gemma 3 GGUF), a Gemma 3 of the same kind (`GEMMA3`
below: sliding layers over 16 positions), whose control is the same weights without the
window (and, in cadence, without the sliding layers' own RoPE base, which llama.cpp then
drops too).

With `--gguf`, the servers read that file instead (a real model; `--tokenizer_from` unused);
`--long_prompt` adds the ~1,500-token prompt below (past a Gemma 3's 512-position window).
With `--yarn_factor`, the file's RoPE is YaRN-scaled from `--yarn_original` positions (the keys
llama.cpp's converter writes for Qwen2.5's and Qwen3's long-context recipe), and a fifth prompt,
the start of docs/architecture.md (~1,500 tokens), runs far past the original context.

No Qwen3 weights can be fetched here, so the file is a small Qwen3-shaped model of random weights:
4 layers, 4 query heads of 128 over a 256-wide stream (as Qwen3-0.6B's heads are wider than
hidden / heads), 2 KV heads, q/k norms whose scales are drawn around 1 (not llama.cpp's ones),
float32 tensors, the tokenizer and chat template of `--tokenizer_from`.

Each prompt goes, as token ids, to llama-server's /completion (temperature 0, its 5 top
probabilities per token, no prompt cache; a float32 KV cache and no flash attention, which on
the CPU rounds through float16) and to cadence-serve's /v1/completions (greedy, top 5
log-probabilities named by token id) on the same file. The script reports, per prompt, whether the greedy tokens
agree and the largest difference between the two servers' log-probabilities of llama.cpp's top 5
at each position.
"""

from __future__ import annotations

import dataclasses
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
from cadence.checkpoints.gguf import PERMUTED_ARCHITECTURES, permute_rope_rows
from cadence.model import params as params_lib
from cadence.model.config import ModelConfig, RopeScaling

sys.path.insert(0, str(Path(__file__).parent))
from prompts import PROMPTS  # noqa: E402

FLAGS = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
TOKENIZER = flags.DEFINE_string("tokenizer_from", None, "a Qwen GGUF whose tokenizer to copy")
GGUF = flags.DEFINE_string("gguf", None, "a GGUF to serve instead of the random Qwen3")
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)
TOKENS = flags.DEFINE_integer("max_tokens", 32, "greedy tokens per prompt")
YARN_FACTOR = flags.DEFINE_float("yarn_factor", 0.0, "YaRN's factor; 0: no RoPE scaling")
YARN_ORIGINAL = flags.DEFINE_integer("yarn_original", 256, "YaRN's original context, in tokens")
ARCH = flags.DEFINE_enum("arch", "qwen3", ["qwen3", "smollm3", "granite", "gemma3"],
                        "the random file's architecture")
LONG = flags.DEFINE_bool("long_prompt", False, "add the start of docs/architecture.md (~1,500 "
                         "tokens) as a fifth prompt (with --yarn_factor, always)")

CONFIG = ModelConfig(name="qwen3-parity", vocab_size=151936, hidden_size=256, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=128, ffn_size=768, rms_norm_eps=1e-6,
                     rope_theta=1e6, tie_embeddings=True, qk_norm=True, max_context=4096)


# SmolLM3's layers: Llama's, every fourth unrotated.
SMOLLM3 = dataclasses.replace(CONFIG, name="smollm3-parity", num_layers=8, head_dim=64, qk_norm=False,
                              rope_theta=1e4, no_rope_layers=(3, 7))


# Granite's: Llama's layers with its four scalars (Granite 3.3 2B's).
GRANITE = dataclasses.replace(SMOLLM3, name="granite-parity", no_rope_layers=(), embedding_multiplier=12.0,
                              residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=8.0)


# Gemma 3's: 270M's kind of layers (one KV head, q/k norms, GELU, norms after each branch,
# embeddings x sqrt(hidden)), 8 of them, of which llama.cpp's pattern of 6 leaves layers 5 and
# 7 global, the others sliding over a window of 16 positions (270M's is 512: the prompts here
# are shorter) with their own RoPE base; the global layers' RoPE linearly scaled (4B's x8),
# the logits soft-capped at 30.
GEMMA3 = dataclasses.replace(
    CONFIG, name="gemma3-parity", vocab_size=262144, num_layers=8, num_kv_heads=1, head_dim=64,
    sliding_window=16, sliding_layers=(0, 1, 2, 3, 4, 6), rope_local_theta=1e4,
    rope_freq_factors=(8.0,) * 32, hidden_act="gelu_tanh", post_norms=True,
    embedding_multiplier=16.0, final_logit_softcapping=30.0)


def model_config() -> ModelConfig:
    if ARCH.value == "gemma3":
        return GEMMA3
    if ARCH.value in ("smollm3", "granite"):
        return SMOLLM3 if ARCH.value == "smollm3" else GRANITE
    if not YARN_FACTOR.value:
        return CONFIG
    return dataclasses.replace(CONFIG, name="qwen3-yarn-parity", rope_scaling=RopeScaling(
        rope_type="yarn", factor=YARN_FACTOR.value, original_max_position=YARN_ORIGINAL.value))


def write_model(path: Path, config: ModelConfig, arch: str) -> None:
    rng = np.random.default_rng(0)
    params = params_lib.random_params(config, jax.random.key(0))
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, config)
    w.add_name(config.name)
    if arch == "gemma3":
        if config.sliding_window:
            w.add_sliding_window(config.sliding_window)
        w.add_key_value("gemma3.rope.freq_base_swa", config.rope_local_theta or config.rope_theta,
                        gguf.GGUFValueType.FLOAT32)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_freq_factors[0])
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "granite":
        w.add_embedding_scale(config.embedding_multiplier)
        w.add_residual_scale(config.residual_multiplier)
        w.add_attention_scale(config.attention_multiplier)
        w.add_logit_scale(config.logits_scaling)
    copy_tokenizer(TOKENIZER.value)(w)
    for spec in params_lib.param_specs(config):
        array = np.asarray(params_lib.get(params, spec.path), np.float32)
        if spec.path[-1] == "scale":
            array = (1 + 0.3 * rng.standard_normal(array.shape)).astype(np.float32)
        array = array.T if spec.transpose else array
        if arch in PERMUTED_ARCHITECTURES and spec.rope_heads:
            array = permute_rope_rows(array, spec.rope_heads)
        w.add_tensor(spec.gguf_name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp(path: Path, prompts: list[list[int]]) -> list[dict]:
    # A float32 KV cache, as cadence's on the CPU (llama.cpp's default is float16), and no flash
    # attention: llama.cpp's CPU flash attention rounds through float16, ~1e-3 off in a logprob.
    out = []
    with serving([FLAGS.value, "-m", str(path), "--port", "8931", "-c", "4096", "-np", "1", "-t", "2",
                 "-ctk", "f32", "-ctv", "f32", "-fa", "off"], 8931) as base:
        for ids in prompts:
            r = httpx.post(f"{base}/completion", timeout=120, json={
                "prompt": ids, "n_predict": TOKENS.value, "temperature": 0, "n_probs": 5,
                "cache_prompt": False, "return_tokens": True}).json()
            steps = [{t["id"]: t["logprob"] for t in p["top_logprobs"]}
                     for p in r["completion_probabilities"]]
            out.append({"tokens": r["tokens"], "top": steps})
    return out


def by_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def cadence(path: Path, prompts: list[list[int]]) -> list[dict]:
    env = dict(os.environ, CADENCE_CACHE=tempfile.mkdtemp(prefix="cadence-parity-"))
    out = []
    with serving([sys.executable, "-m", "cadence.server.serve_cli", f"--model={path}", "--port=8932",
                 "--num_slots=2", "--max_seq_len=2048", "--served_model_name=m"], 8932, env) as base:
        for ids in prompts:
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": "m", "prompt": ids, "max_tokens": TOKENS.value, "temperature": 0,
                "logprobs": 5, "ignore_eos": True, "return_tokens_as_token_ids": True}).json()
            lp = r["choices"][0]["logprobs"]
            out.append({"tokens": [by_id(t) for t in lp["tokens"]],
                        "top": [{by_id(k): v for k, v in top.items()} for top in lp["top_logprobs"]]})
    return out


def compare(prompts: list[list[int]], theirs: list[dict], ours: list[dict]) -> list[dict]:
    """Per prompt: how many greedy tokens agree, and the log-probabilities' largest difference
    up to where they part (printed as it goes)."""
    rows = []
    for ids, a, b in zip(prompts, theirs, ours):
        agree = 0
        while agree < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][agree] == b["tokens"][agree]:
            agree += 1
        # Through the first position where they part, both saw the same tokens. The top 5s
        # are compared where both name a token (a near tie at rank 5 may swap the fifth).
        pairs = list(zip(a["top"][:agree + 1], b["top"][:agree + 1]))
        diffs = [abs(top[t] - mine[t]) for top, mine in pairs for t in top if t in mine]
        same_sets = sum(set(top) == set(mine) for top, mine in pairs)
        row = {"prompt_tokens": len(ids), "greedy_tokens": TOKENS.value, "tokens_agree": agree,
               "max_logprob_diff": max(diffs, default=None), "positions_compared": len(pairs),
               "positions_with_the_same_top5": same_sets,
               "llama_cpp": a["tokens"], "cadence": b["tokens"]}
        line = (f"{len(ids):4d} prompt tokens: {agree}/{TOKENS.value} greedy tokens agree; the same "
                f"top 5 at {same_sets}/{len(pairs)} positions; max |logprob difference| "
                + (f"{max(diffs):.2e}" if diffs else "none (no token in both top 5s)"))
        if agree < TOKENS.value:  # how close the two choices were, by llama.cpp's numbers
            top = a["top"][agree]
            row["gap_where_they_part"] = top[a["tokens"][agree]] - top.get(b["tokens"][agree], float("-inf"))
            line += f"; where they part, llama.cpp's top two differ by {row['gap_where_they_part']:.2e}"
        rows.append(row)
        print(line)
    return rows


def main(argv: list[str]) -> None:
    del argv
    from cadence.checkpoints.gguf_file import read_gguf
    from cadence.checkpoints.tokenizer import Tokenizer

    config = model_config()
    folder = Path(tempfile.mkdtemp(prefix="parity-"))
    if GGUF.value:
        path = Path(GGUF.value)
    else:
        path = folder / f"{config.name}.gguf"
        write_model(path, config, ARCH.value)
    tok = Tokenizer.from_gguf_fields(read_gguf(path)[0])
    texts = PROMPTS + ([(Path(__file__).parents[3] / "docs" / "architecture.md").read_text()[:6000]]
                       if YARN_FACTOR.value or LONG.value else [])
    prompts = [tok.encode(p) for p in texts]
    theirs = llama_cpp(path, prompts)
    rows = compare(prompts, theirs, cadence(path, prompts))
    result = {"gguf": path.name} if GGUF.value else {"config": json.loads(config.to_json())}
    result["prompts"] = rows
    if ARCH.value == "gemma3" and not GGUF.value:  # the control: every layer global
        print("control: cadence on the same weights as a gemma3 file without a sliding window")
        control = folder / "no-window.gguf"
        write_model(control, dataclasses.replace(config, sliding_window=0, sliding_layers=()), "gemma3")
        result["control_without_the_window"] = compare(prompts, theirs, cadence(control, prompts))
    elif ARCH.value in ("smollm3", "granite") and not GGUF.value:  # the control: plain Llama
        print("control: cadence on the same weights as a llama file (every layer rotated, no scalars)")
        control = folder / "as-llama.gguf"
        write_model(control, dataclasses.replace(
            config, no_rope_layers=(), embedding_multiplier=1.0, residual_multiplier=1.0,
            attention_multiplier=None, logits_scaling=1.0), "llama")
        result["control_as_plain_llama"] = compare(prompts, theirs, cadence(control, prompts))
    Path(OUT.value).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
