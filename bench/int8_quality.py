"""How far int8 weights move the default model: logits and greedy tokens against float32.

    python -m cadence.bench.int8_quality --out=bench/results/int8-cpu/quality.json

For a few prompts (plain text, a chat, code): the largest logit difference over the prompt's
positions (relative to the largest logit magnitude), whether the top-1 token agrees at each
prompt position, and how many of 32 greedy tokens equal float32's before the first difference.
The reference generator runs both models (the int8 one as its dequantized weights, which is
what the engine computes: `tests/test_real_model.py` checks the engine equals it).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.engine.reference import greedy_generate
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model.quant import dequantize, quantize

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "Greedy tokens per prompt.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")


def prompt_logits(params, config, ids) -> np.ndarray:
    n = len(ids)
    tokens = np.asarray([ids], np.int32)
    cache = PagedKVCache.create(config, 1, n)
    logits, _ = jax.jit(lambda p, c: forward(
        p, tokens, np.arange(n, dtype=np.int32)[None], np.array([n], np.int32), c,
        np.zeros((1, 1), np.int32), config=config, attention="reference"))(params, cache)
    return np.asarray(logits[0])


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    tok, cfg = model.tokenizer, model.config
    floats = dequantize(quantize(model.params, cfg), cfg)
    prompts = {
        "text": "The history of the Roman Empire spans many centuries, and",
        "chat": tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
        "code": "def fibonacci(n):\n    ",
    }
    rows = []
    for name, text in prompts.items():
        ids = tok.encode(text)
        a, b = prompt_logits(model.params, cfg, ids), prompt_logits(floats, cfg, ids)
        want = greedy_generate(model.params, cfg, ids, _TOKENS.value, tok.eos_ids)
        got = greedy_generate(floats, cfg, ids, _TOKENS.value, tok.eos_ids)
        same = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
        rows.append({"prompt": name, "prompt_tokens": len(ids),
                     "max_logit_diff_relative": float(np.abs(a - b).max() / np.abs(a).max()),
                     "top1_agreement_over_prompt": float(np.mean(a.argmax(-1) == b.argmax(-1))),
                     "greedy_tokens_equal_before_first_difference": same, "greedy_tokens": len(want),
                     "float32_text": tok.decode(want), "int8_text": tok.decode(got)})
        print(json.dumps(rows[-1]))
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps({"model": _MODEL.value, "jax_version": jax.__version__,
                                                "rows": rows}, indent=2))


if __name__ == "__main__":
    app.run(main)
