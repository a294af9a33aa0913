"""cadence's served tokens on a GGUF against the reference generator over the file's weights as
`gguf.quants` dequantizes them (float32, no CPU kernels): the check that decode over the file's
own blocks computes what the file holds.

    python bench/results/q3k-cpu/reference.py --gguf=qwen3-q3_k_m.gguf \
        --parity=bench/results/q3k-cpu/parity.json

`--parity`: `../qwen3-cpu/parity.py`'s output for the same file, whose "cadence" tokens (greedy,
served by cadence-serve) are compared with the reference's for the same prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

from cadence.checkpoints.gguf import load_gguf
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate

sys.path.insert(0, str(Path(__file__).parents[1] / "qwen3-cpu"))
from prompts import PROMPTS  # noqa: E402  (the prompts parity.py served)

GGUF = flags.DEFINE_string("gguf", None, "the GGUF served", required=True)
PARITY = flags.DEFINE_string("parity", None, "parity.py's JSON for that file", required=True)


def main(argv: list[str]) -> None:
    del argv
    config, params, fields = load_gguf(GGUF.value)
    tok = Tokenizer.from_gguf_fields(fields)
    served = json.loads(Path(PARITY.value).read_text())["prompts"]
    for text, row in zip(PROMPTS, served):
        prompt = tok.encode(text)
        want = greedy_generate(params, config, prompt, len(row["cadence"]))
        agree = next((i for i, (a, b) in enumerate(zip(want, row["cadence"])) if a != b), len(want))
        print(f"{len(prompt):4d} prompt tokens: cadence-serve's {len(row['cadence'])} greedy tokens "
              f"and the reference's agree for {agree}")


if __name__ == "__main__":
    app.run(main)
