"""How far each weight format moves the default model from float32: logits and greedy tokens.

    python -m cadence.bench.weights_quality --out=bench/results/weights-cpu/quality.json

The formats are the ones cadence serves:
- float32: the checkpoint's weights, dequantized;
- gguf: the file's own Q4_1 / Q8_0 blocks, read by the grouped CPU kernels (--weights=auto);
- gguf-int8-activations: the same blocks against activations quantized to int8 per 32 values
  (--cpu_activations=int8);
- int8-grouped, int4-grouped: every matrix re-quantized in groups of 32 (--weights=int8 and
  int4 on the CPU kernels);
- int8-channel: int8 with one scale per output channel (--weights=int8 off the CPU kernels).

Each one runs as the engine does: XLA prefills the prompt over the floats the format stands
for, then the decode program runs a token at a time (on the CPU kernels where they build,
over the format's own matrices). Per prompt (text, chat and code):
- logits: teacher-forced over the prompt's last token and float32's 32 greedy tokens, the
  largest |logit - float32's| relative to float32's largest |logit|, and the share of
  positions whose top-1 token agrees;
- greedy: how many of 32 greedy tokens equal float32's before the first difference.
float32 itself is run through the same decode path and compared with the reference
generator's full-sequence logits, which says what summation order alone costs.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.engine.reference import greedy_generate, sequence_logits
from cadence.model import cpu_kernels
from cadence.model.arith import cdiv
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model.quant import dequantize, quantize, quantize_grouped

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model.")
_TOKENS = flags.DEFINE_integer("tokens", 32, "Greedy tokens per prompt.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")
_FORMATS = flags.DEFINE_list("formats", [], "Only these formats (float32 always runs): default all.")

PAGE = 16


def prompts(tok) -> dict[str, str]:
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    return {
        "text-rome": "The history of the Roman Empire spans many centuries, and",
        "text-science": "Photosynthesis is the process by which plants",
        "text-story": "Once upon a time, in a small village by the sea, there lived",
        "text-facts": "The three largest cities in Europe are",
        "chat-colours": chat("Name three colours."),
        "chat-advice": chat("How can I sleep better at night?"),
        "chat-explain": chat("Explain what a prime number is to a child."),
        "code-fibonacci": "def fibonacci(n):\n    ",
        "code-sort": "# Sort a list of dictionaries by the 'age' key\ndef sort_by_age(people):\n",
        "code-js": "function isPalindrome(s) {\n  ",
    }


class Decoder:
    """One format as the engine runs it: `prefill_params` (floats) for the prompt through XLA,
    `decode_params` for each step (the CPU kernels' tree, or the params again on XLA)."""

    def __init__(self, config, prefill_params, decode_params, attention: str,
                 activations: str = "float32"):
        self.config = config
        self.prefill_params, self.decode_params = prefill_params, decode_params
        self.attention = attention

        # The CPU kernels' activations, as the engine's programs take them.
        self._run = jax.jit(cpu_kernels.with_activations(forward, activations),
                            static_argnames=("config", "attention"))

    def run(self, prompt: list[int], feed: list[int] | None, n: int, eos: tuple[int, ...] = ()):
        """(logits after the prompt and after each fed token [1 + steps, V], the tokens fed):
        `feed`'s tokens (teacher-forced), or with feed None up to n greedy ones (each argmax
        fed back, stopping at an EOS)."""
        steps = len(feed) if feed is not None else n
        pages = cdiv(len(prompt) + steps, PAGE) + 1
        cache = PagedKVCache.create(self.config, pages, PAGE)
        table = np.arange(pages, dtype=np.int32)[None]
        logits, cache = self._run(self.prefill_params, np.asarray([prompt], np.int32),
                                  np.arange(len(prompt), dtype=np.int32)[None],
                                  np.array([len(prompt)], np.int32), cache, table, config=self.config)
        out, fed = [np.asarray(logits[0, -1])], []
        while len(fed) < steps:
            token = feed[len(fed)] if feed is not None else int(out[-1].argmax())
            fed.append(token)
            if feed is None and token in eos:
                break
            if feed is None and len(fed) == steps:
                break  # the last greedy token needs no logits after it
            position = np.array([[len(prompt) + len(fed) - 1]], np.int32)
            logits, cache = self._run(self.decode_params, np.array([[token]], np.int32), position,
                                      np.ones(1, np.int32), cache, table, config=self.config,
                                      attention=self.attention)
            out.append(np.asarray(logits[0, -1]))
        return np.stack(out), fed


def formats(model, wanted=()) -> dict[str, Decoder]:
    """Every format, or float32 and those `wanted` names."""
    cfg, params = model.config, model.params
    kernels = cpu_kernels.available()
    attention = "cpu" if kernels else "xla"
    tree = (lambda p, packed=None: cpu_kernels.decode_params(p, packed)) if kernels else (lambda p, packed=None: p)
    want = lambda name: not wanted or name in wanted  # noqa: E731
    out = {"float32": Decoder(cfg, params, tree(params), attention)}
    if kernels and model.packed and (want("gguf") or want("gguf-int8-activations")):
        blocks = tree(params, {p: a for p, (a, _) in model.packed.items()})
        if want("gguf"):
            out["gguf"] = Decoder(cfg, params, blocks, attention)
        if want("gguf-int8-activations"):
            out["gguf-int8-activations"] = Decoder(cfg, params, blocks, attention, activations="int8")
    for name, fmt in (("int8-grouped", "q8"), ("int4-grouped", "q4")):
        if kernels and want(name):
            floats, packed = quantize_grouped(params, cfg, fmt)
            out[name] = Decoder(cfg, floats, tree(floats, packed), attention)
    if want("int8-channel"):
        int8 = quantize(params, cfg)
        out["int8-channel"] = Decoder(cfg, dequantize(int8, cfg), tree(int8), attention)
    return out


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    tok, cfg = model.tokenizer, model.config
    decoders = formats(model, _FORMATS.value)
    rows = []
    for name, text in prompts(tok).items():
        ids = tok.encode(text)
        want = greedy_generate(model.params, cfg, ids, _TOKENS.value, tok.eos_ids)
        exact = np.asarray(sequence_logits(model.params, cfg, ids + want))[len(ids) - 1:-1]
        base = decoders["float32"].run(ids, want[:-1], 0)[0]  # logits at each of want's tokens
        for fmt, decoder in decoders.items():
            got = base if fmt == "float32" else decoder.run(ids, want[:-1], 0)[0]
            against = exact if fmt == "float32" else base
            greedy = decoder.run(ids, None, _TOKENS.value, tok.eos_ids)[1]
            same = next((i for i, (x, y) in enumerate(zip(want, greedy)) if x != y), min(len(want), len(greedy)))
            rows.append({
                "prompt": name, "format": fmt, "prompt_tokens": len(ids),
                "against": "reference" if fmt == "float32" else "float32",
                "max_logit_diff_relative": float(np.abs(got - against).max() / np.abs(against).max()),
                "top1_agreement": float(np.mean(got.argmax(-1) == against.argmax(-1))),
                "greedy_equal_before_first_difference": same, "greedy_tokens": len(want),
                "text": tok.decode(greedy)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
    summary = {}
    for fmt in decoders:
        mine = [r for r in rows if r["format"] == fmt]
        summary[fmt] = {
            "max_logit_diff_relative": max(r["max_logit_diff_relative"] for r in mine),
            "mean_top1_agreement": float(np.mean([r["top1_agreement"] for r in mine])),
            "greedy_equal_prompts": sum(r["greedy_equal_before_first_difference"] == r["greedy_tokens"] for r in mine),
            "greedy_equal_tokens": sum(r["greedy_equal_before_first_difference"] for r in mine),
            "greedy_tokens": sum(r["greedy_tokens"] for r in mine), "prompts": len(mine)}
    print("| format | max logit diff (of range) | top-1 agreement | greedy prompts equal | tokens before first difference |")
    print("| --- | --- | --- | --- | --- |")
    for fmt, s in summary.items():
        print(f"| {fmt} | {100 * s['max_logit_diff_relative']:.4f}% | {100 * s['mean_top1_agreement']:.1f}% | "
              f"{s['greedy_equal_prompts']}/{s['prompts']} | {s['greedy_equal_tokens']}/{s['greedy_tokens']} |")
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps({
            "model": _MODEL.value, "jax_version": jax.__version__, "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine(), "cpu_kernels": cpu_kernels.available(),
            "summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    app.run(main)
