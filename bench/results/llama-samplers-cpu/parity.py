"""cadence's llama.cpp samplers against llama-server's, on the default model: at every step of
llama-server's answer, the tokens its sampler chain leaves and their probabilities, and cadence's
over the same context; and the same greedy answers from both servers.

    llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf smollm2-f32.gguf F32
    python bench/results/llama-samplers-cpu/parity.py --llama_server=<llama-server> \
        --gguf=smollm2-f32.gguf --out=bench/results/llama-samplers-cpu/parity.json

The default model's weights, written out as float32 (llama.cpp's Q4_1 dot products quantize the
activations too, which moves its logprobs by up to 0.2 from cadence's float32; from the same
float32 weights both compute the same logits to about 1e-5).

llama-server answers each prompt, case by case, with `post_sampling_probs` and `n_probs` 100:
each step's list is what its chain (top-n-sigma, top-k, typical, top-p, min_p, XTC, the
temperature, dynamic or not) left, up to 100 tokens, with the probabilities its final draw
uses. cadence computes the same step from its own logits of the prompt and llama-server's
answer so far (the reference forward, float32) with `model.sampling.kept`, the function its
programs run, at the case's `RequestSampling` as /completion parses it. XTC runs at probability
1, so that both cut at every step. Then cadence-serve and llama-server answer the greedy cases
(temperature 0, where typical_p and XTC still move the answer) and the tokens are compared.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.bench.cadence_server import serving
from cadence.checkpoints import registry
from cadence.engine.reference import sequence_logits
from cadence.model.host_sampling import MAX_DRY_BREAKERS, NO_TOKEN, SAMPLER_STATE, SamplingRows, dry_matches
from cadence.model.sampling import TokenHistory, adaptive, adjust_logits, kept, mirostat, sampler_moved
from cadence.server import llama_api, llama_sampling, parsing

LLAMA = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
GGUF = flags.DEFINE_string("gguf", None, "the default model's weights as an F32 GGUF", required=True)
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)
TOKENS = flags.DEFINE_integer("answer_tokens", 12, "tokens per answer")
N_PROBS = 100
AGREE = 1e-4  # float32 logits from the same weights: ~1e-5 apart

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Here is a list of fruits: apple, banana,",
    " ".join(["the quick brown fox jumps over the lazy dog."] * 4),
]
# Every sampler alone, then together; each case states every field llama-server would
# otherwise default (its top_k 40, top_p 0.95, min_p 0.05, temperature 0.8).
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "top_n_sigma": -1.0,
       "xtc_probability": 0.0, "xtc_threshold": 0.1, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
       "repeat_penalty": 1.0, "dry_multiplier": 0.0}
CASES = {
    "top_n_sigma 1": {"temperature": 0.9, "top_n_sigma": 1.0},
    "typical_p 0.7": {"temperature": 0.8, "typical_p": 0.7},
    "typical_p 0.9, top_k 50": {"temperature": 1.0, "typical_p": 0.9, "top_k": 50},
    "xtc 0.1": {"temperature": 0.8, "xtc_probability": 1.0, "xtc_threshold": 0.1, "top_k": 60},
    "dynatemp 0.5": {"temperature": 0.8, "dynatemp_range": 0.5, "top_k": 40},
    "dynatemp 1.2, exponent 2": {"temperature": 1.0, "dynatemp_range": 1.2, "dynatemp_exponent": 2.0,
                                 "top_k": 30},
    "temperature last: top_p 0.9, min_p 0.05 at 1.5": {"temperature": 1.5, "top_p": 0.9, "min_p": 0.05},
    "llama-server's defaults + all four": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                           "top_n_sigma": 2.0, "typical_p": 0.95, "xtc_probability": 1.0,
                                           "xtc_threshold": 0.08, "dynatemp_range": 0.3},
    "dry 0.8 over 2048": {"temperature": 0.8, "top_k": 40, "dry_multiplier": 0.8, "dry_penalty_last_n": 2048},
    "dry 2, base 1.3, allowed 1, last 16, breakers . and ,": {
        "temperature": 1.0, "top_k": 50, "dry_multiplier": 2.0, "dry_base": 1.3, "dry_allowed_length": 1,
        "dry_penalty_last_n": 16, "dry_sequence_breakers": [".", ","]},
    # a constant penalty (base 1), mild enough that the answer goes on repeating the prompt
    "dry 0.3, base 1": {"temperature": 1.0, "top_k": 40, "dry_multiplier": 0.3, "dry_base": 1.0},
    "greedy, dry 1.5, allowed 1": {"temperature": 0.0, "dry_multiplier": 1.5, "dry_allowed_length": 1},
    "greedy, typical_p 0.5": {"temperature": 0.0, "typical_p": 0.5},
    "greedy, xtc 0.05": {"temperature": 0.0, "xtc_probability": 1.0, "xtc_threshold": 0.05, "top_k": 20},
    "greedy, dynatemp 0.7": {"temperature": 0.0, "dynatemp_range": 0.7, "top_k": 20},
    # Mirostat, which replaces the chain: its bound carried over the answer's tokens (below)
    "mirostat 2, tau 5": {"temperature": 0.8, "mirostat": 2},
    "mirostat 2, tau 3, eta 0.3 at 1.2": {"temperature": 1.2, "mirostat": 2, "mirostat_tau": 3.0,
                                          "mirostat_eta": 0.3},
    "mirostat 1, tau 5": {"temperature": 0.8, "mirostat": 1},
    "mirostat 1, tau 8, eta 0.5 at 1.5": {"temperature": 1.5, "mirostat": 1, "mirostat_tau": 8.0,
                                          "mirostat_eta": 0.5},
    # adaptive-p, the draw where `samplers` names it last: its average carried likewise
    "adaptive-p 0.2 after top_k 40": {"temperature": 0.8, "top_k": 40, "adaptive_target": 0.2,
                                      "samplers": ["top_k", "temperature", "adaptive_p"]},
    "adaptive-p 0.5, decay 0.5 after min_p 0.05 at 1.2": {
        "temperature": 1.2, "min_p": 0.05, "adaptive_target": 0.5, "adaptive_decay": 0.5,
        "samplers": ["min_p", "temperature", "adaptive_p"]},
}


def ask(url: str, ids: list[int], fields: dict) -> dict:
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": TOKENS.value, "n_probs": N_PROBS, "post_sampling_probs": True,
        "seed": 1234, "cache_prompt": False, "return_tokens": True, **OFF, **fields})
    r.raise_for_status()
    return r.json()


SET_ROW = jax.jit(TokenHistory.set_row)
MIROSTAT, ADAPTIVE, MOVED = jax.jit(mirostat), jax.jit(adaptive), jax.jit(sampler_moved)
BREAKERS: llama_sampling.DryBreakers  # the served vocabulary's (main)


def cadence_steps(params, config, ids: list[int], answer: list[int], fields: dict,
                  **control) -> list[dict[int, float]]:
    """cadence's distribution at each step of `answer` after `ids`: {token: probability}
    (`control`: RequestSampling fields to change, for the controls)."""
    parsed, _ = llama_api.parse_completion({"prompt": ids, **OFF, **fields}, parsing.SamplingDefaults())
    sampling = parsed.params.sampling
    breaker_ids = BREAKERS.ids(parsed.dry_breakers) if sampling.dry_multiplier else ()  # as the server's
    sampling = dataclasses.replace(sampling, dry_breakers=breaker_ids, **control)
    sequence = ids + answer
    logits = sequence_logits(params, config, sequence)[len(ids) - 1:]
    rows = SamplingRows.of([sampling] * len(logits)).params()
    # Each step's penalties and DRY as the programs apply them, over its own history.
    breakers = np.full(MAX_DRY_BREAKERS, NO_TOKEN, np.int32)
    breakers[: len(sampling.dry_breakers)] = sampling.dry_breakers
    slots, seq = jnp.arange(len(logits), dtype=jnp.int32), len(sequence)
    history = TokenHistory.create(len(logits), config.vocab_size, seq)
    for step in range(len(logits)):
        known = np.full(seq, NO_TOKEN, np.int32)
        known[: len(ids) + step] = sequence[: len(ids) + step]
        match = np.zeros(seq, np.int32)
        if sampling.dry_multiplier:
            match[: len(ids) + step] = dry_matches(known[: len(ids) + step])
        history = SET_ROW(history, jnp.int32(step), known, jnp.int32(len(ids)),
                          jnp.int32(sampling.penalty_window), breakers, match, np.zeros(SAMPLER_STATE, np.float32))
    logits = jax.jit(adjust_logits)(jnp.asarray(logits), rows, history, slots)
    rngs = jax.vmap(lambda t: jax.random.fold_in(jax.random.key(sampling.seed), t))(jnp.arange(len(logits)))
    draw, keep, hot = jax.jit(kept)(logits, rows, rngs)
    if sampling.stateful:  # Mirostat's bound, adaptive-p's average: moved by each answer token
        draw, keep = np.asarray(draw).copy(), np.asarray(keep).copy()
        state = np.asarray([sampling.sampler_state], np.float32)
        row = SamplingRows.of([sampling]).params()
        for step, token in enumerate(answer):
            at = slice(step, step + 1)
            keep[at] = MIROSTAT(draw[at], keep[at], row, state[:, 0])
            scaled = draw[at].copy()
            draw[at] = ADAPTIVE(scaled, keep[at], row, state)  # (what adaptive-p draws from)
            state = MOVED(scaled, keep[at], hot[at], jnp.asarray([token]), row, state)
    logits = np.asarray(logits)
    out = []
    for x, k, h, raw in zip(np.asarray(draw, np.float64), np.asarray(keep), np.asarray(hot), logits):
        if not h:
            out.append({int(np.argmax(np.where(k, raw, -np.inf))): 1.0})
            continue
        x = np.where(k, x, -np.inf)
        p = np.exp((x - x.max()).astype(np.float32)).astype(np.float64)  # zero where expf underflows, as there
        p /= p.sum()
        out.append({int(t): float(p[t]) for t in np.flatnonzero(p > 0)})
    return out[: len(answer)]


def compare(theirs: list[dict], ours: list[dict[int, float]]) -> dict:
    """Per step: whether the listed tokens are cadence's likeliest (as many as listed, or all
    of cadence's where llama-server listed fewer than N_PROBS) with every probability within
    AGREE of cadence's; and the largest gap in probability over the steps that list the same."""
    same, worst, sizes = 0, 0.0, []
    for step, mine in zip(theirs, ours):
        listed = {t["id"]: t["prob"] for t in step["top_probs"]}
        top = dict(sorted(mine.items(), key=lambda kv: -kv[1])[: len(listed)])
        whole = len(listed) < N_PROBS
        sizes.append(len(mine))
        if set(listed) == set(top) and (not whole or len(mine) == len(listed)):
            gap = max(abs(listed[t] - top[t]) for t in listed)
            same += gap <= AGREE
            worst = max(worst, gap)
        else:
            worst = float("inf")
    return {"steps": len(ours), "agree": same, "max_prob_gap": worst, "kept_sizes": sizes}


def main(argv: list[str]) -> None:
    del argv
    global BREAKERS
    gguf = Path(GGUF.value)
    model = registry.load_model(str(gguf))
    BREAKERS = llama_sampling.DryBreakers(model.tokenizer)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    results = {"model": gguf.name, "max_tokens": TOKENS.value, "n_probs": N_PROBS, "cases": {}}
    with serving([LLAMA.value, "-m", str(gguf), "--port", "8932", "-c", "2048", "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32",
                  "-fa", "off"], 8932) as url:
        theirs = {name: [ask(url, ids, fields) for ids in prompts] for name, fields in CASES.items()}
    for name, fields in CASES.items():
        rows = []
        for ids, body in zip(prompts, theirs[name]):
            answer = body["tokens"]
            ours = cadence_steps(model.params, model.config, ids, answer, fields)
            rows.append({"tokens": answer, **compare(body["completion_probabilities"], ours)})
        results["cases"][name] = rows
        agree = sum(r["agree"] for r in rows)
        total = sum(r["steps"] for r in rows)
        gap = max(r["max_prob_gap"] for r in rows)
        print(f"{name:48s} steps agreeing {agree}/{total}, largest probability gap {gap:.2e}", file=sys.stderr)
    # The controls, which must part: the temperature-last case in vLLM's order (the temperature
    # first), a DRY case with cadence's DRY off, and a Mirostat case whose bound cadence never
    # moves (eta 0).
    for key, name, change in (("control_vllm_order", "temperature last: top_p 0.9, min_p 0.05 at 1.5",
                               {"temperature_last": False}),
                              ("control_no_dry", "dry 0.3, base 1", {"dry_multiplier": 0.0}),
                              ("control_no_dry_greedy", "greedy, dry 1.5, allowed 1", {"dry_multiplier": 0.0}),
                              ("control_mirostat_bound_held", "mirostat 2, tau 3, eta 0.3 at 1.2",
                               {"mirostat_eta": 0.0})):
        control = [compare(body["completion_probabilities"],
                           cadence_steps(model.params, model.config, ids, body["tokens"], CASES[name], **change))
                   for ids, body in zip(prompts, theirs[name])]
        results[key] = control
        print(f"{'control: ' + name + ' with ' + str(change):48s} steps agreeing "
              f"{sum(r['agree'] for r in control)}/{sum(r['steps'] for r in control)}", file=sys.stderr)
    greedy = {n: f for n, f in CASES.items() if f["temperature"] == 0 and not f.get("dynatemp_range")}
    with serving([sys.executable, "-m", "cadence.server.serve_cli", "--model", str(gguf), "--port", "8933",
                  "--num_slots", "2"],
                 8933) as url:
        for name, fields in greedy.items():
            ours = [_cadence_greedy(url, ids, fields) for ids in prompts]
            same = sum(o == b["tokens"] for o, b in zip(ours, theirs[name]))
            results["cases"][name].append({"greedy_answers_equal": same, "of": len(prompts)})
            print(f"{name:48s} greedy answers equal {same}/{len(prompts)}", file=sys.stderr)
    Path(OUT.value).write_text(json.dumps(results, indent=1) + "\n")


def _cadence_greedy(url: str, ids: list[int], fields: dict) -> list[int]:
    """cadence-serve's /completion answer (it refuses post_sampling_probs, and needs no seed)."""
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": TOKENS.value, "return_tokens": True, **OFF, **fields})
    r.raise_for_status()
    return r.json()["tokens"]


if __name__ == "__main__":
    app.run(main)
