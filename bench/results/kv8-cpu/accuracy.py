"""What a narrow KV pool costs in accuracy: the reference generator over a cache of each dtype
(keys and values rounded as written, saturated, widened as read; the engine over such a pool
gives the same greedy tokens, tests/test_cpu_kernels.py) against the float32 cache.

    python bench/results/kv8-cpu/accuracy.py --model=smollm2-135m --out=bench/results/kv8-cpu/accuracy-smollm2.json

Per chat prompt: the float32 cache's greedy answer (`--max_tokens`); then, for each dtype,
- teacher-forced over that same prompt + answer, one forward pass: how far the log-probability
  of each answer token moves from the float32 cache's (mean and max over the answer), and how
  often the argmax at an answer position still names the same token;
- free-running greedy: the first answer position where its tokens differ from float32's
  (the answer's length: never).
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.engine import reference
from cadence.model.paged_kv import PagedKVCache

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model.")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"], "Cache dtypes.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Answer tokens per prompt.")
_PROMPTS = flags.DEFINE_integer("prompts", 4, "How many of PROMPTS to run.")
_OUT = flags.DEFINE_string("out", None, "JSON results.")

PROMPTS = [
    "Explain how a transformer's attention works, in detail.",
    "Write a Python function that merges two sorted lists, with a docstring.",
    "What were the main causes of the First World War?",
    "Summarize the plot of Hamlet in a paragraph.",
]


def answer_logprobs(model, ids: list[int], dtype: str) -> np.ndarray:
    """[len(ids) - 1] float64: each token's log-probability after the ones before it, in one
    forward pass over a cache of `dtype`; and the argmax at each position."""
    cache = PagedKVCache.create(model.config, num_pages=1, page_size=len(ids), dtype=jnp.dtype(dtype))
    logits = reference._every_position(model.params, jnp.asarray([ids], jnp.int32), cache,
                                       config=model.config)
    lsm = reference.log_softmax(np.asarray(logits, np.float32))[:-1]
    return lsm[np.arange(len(ids) - 1), ids[1:]], lsm.argmax(-1)


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    tok = model.tokenizer
    rows = []
    for text in PROMPTS[: _PROMPTS.value]:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        base = reference.greedy_generate(model.params, model.config, prompt, _MAX_TOKENS.value, tok.eos_ids)
        ids = prompt + base
        exact, exact_argmax = answer_logprobs(model, ids, "float32")
        span = slice(len(prompt) - 1, None)  # the answer's positions
        for dtype in _DTYPES.value:
            forced, argmax = answer_logprobs(model, ids, dtype)
            moved = np.abs(forced - exact)[span]
            free = reference.greedy_generate(model.params, model.config, prompt, _MAX_TOKENS.value,
                                             tok.eos_ids, kv_dtype=dtype)
            first = next((i for i, (a, b) in enumerate(zip(base, free)) if a != b), min(len(base), len(free)))
            row = {"prompt": text, "prompt_tokens": len(prompt), "answer_tokens": len(base), "dtype": dtype,
                   "logprob_moved_mean": float(moved.mean()), "logprob_moved_max": float(moved.max()),
                   "argmax_same": float(np.mean(argmax[span] == exact_argmax[span])),
                   "first_difference": first}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for dtype in _DTYPES.value:
        mine = [r for r in rows if r["dtype"] == dtype]
        summary[dtype] = {"logprob_moved_mean": float(np.mean([r["logprob_moved_mean"] for r in mine])),
                          "logprob_moved_max": max(r["logprob_moved_max"] for r in mine),
                          "argmax_same": float(np.mean([r["argmax_same"] for r in mine])),
                          "first_difference": [r["first_difference"] for r in mine],
                          "answer_tokens": [r["answer_tokens"] for r in mine]}
        print(f"{dtype:14s} |dlogp| mean {summary[dtype]['logprob_moved_mean']:.4f} "
              f"max {summary[dtype]['logprob_moved_max']:.3f}  argmax same {summary[dtype]['argmax_same']:.3f}  "
              f"first difference {summary[dtype]['first_difference']} of {summary[dtype]['answer_tokens']}")
    if _OUT.value:
        Path(_OUT.value).write_text(json.dumps({
            "model": Path(_MODEL.value).name, "max_tokens": _MAX_TOKENS.value, "rows": rows, "summary": summary,
            "processor": platform.processor() or platform.machine(), "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat()}, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
