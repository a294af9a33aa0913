"""What a thinking model's format costs per token: the bitmask of a JSON object's grammar, and of
the same format after free reasoning (`scheduler.grammar.Thinking`), on Qwen2.5's vocabulary of
151,936 (Qwen3's size), for one answer's tokens.

    python bench/results/qwen3-cpu/thinking_mask.py qwen.gguf > bench/results/qwen3-cpu/thinking_mask.txt
"""

import sys
import time

import numpy as np

from cadence.checkpoints.gguf_file import read_gguf
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.model.host_sampling import bitmask_words
from cadence.scheduler.grammar import GrammarCompiler, JsonObject, Thinking

VOCAB = 151936
ANSWER = '{"name": "Ann", "age": 30}'
REASONING = ("<think>\nThe user wants a JSON object describing a person. Let me pick a name, an "
             "age and a city, then write them as keys.\n</think>\n\n")

tokenizer = Tokenizer.from_gguf_fields(read_gguf(sys.argv[1])[0])
compiler = GrammarCompiler(tokenizer, VOCAB)
for spec, text in ((JsonObject(), ANSWER), (Thinking(JsonObject()), REASONING + ANSWER)):
    grammar = compiler.compile(spec)
    matcher = grammar.matcher()
    row = np.zeros(bitmask_words(VOCAB), np.int32)
    times = []
    for token in tokenizer.encode(text, add_bos=False):
        start = time.perf_counter()
        matcher.fill(row)
        times.append(time.perf_counter() - start)
        assert matcher.accept(token), (spec, token)
    print(f"{type(spec).__name__:10s} compile {grammar.compile_seconds * 1e3:.1f} ms; a token's mask: "
          f"median {np.median(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us over {len(times)} "
          f"tokens; complete: {matcher.done}")
compiler.close()
