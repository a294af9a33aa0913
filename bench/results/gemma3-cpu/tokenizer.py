"""Gemma 3's tokenizer, as cadence rebuilds it from a GGUF, against llama.cpp's: the same ids.

    python bench/results/gemma3-cpu/tokenizer.py --llama_server=<llama-server> \
        --gguf=gemma3.gguf --out=bench/results/gemma3-cpu/tokenizer.json

A Gemma 3 GGUF carries a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": 262,144
pieces with scores, byte fallback, no space prefix, user-defined pieces for whitespace runs and
markup). cadence rebuilds it as a SentencePiece model (`checkpoints/tokenizer.py`). The 14 texts
of `../pretokenizers-cpu/parity.py` and a Gemma chat turn go to llama-server's /tokenize (no
BOS; the turn with its control tokens parsed, the texts without) and to cadence's tokenizer from
the same file. Reported: the texts whose ids agree, and for the others where they part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
from absl import app, flags

from cadence.bench.cadence_server import serving
from cadence.checkpoints.gguf_file import read_gguf
from cadence.checkpoints.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "pretokenizers-cpu"))
from texts import TEXTS  # noqa: E402

SERVER = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
GGUF = flags.DEFINE_string("gguf", None, "a Gemma 3 GGUF", required=True)
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)

TURN = "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"


def main(argv: list[str]) -> None:
    del argv
    ours = Tokenizer.from_gguf_fields(read_gguf(GGUF.value)[0])
    cases = [(text, False) for text in TEXTS] + [(TURN, True)]
    with serving([SERVER.value, "-m", GGUF.value, "--port", "8950", "-c", "512", "-np", "1", "-t", "2"],
                 8950) as base:
        theirs = [httpx.post(f"{base}/tokenize", timeout=60, json={
            "content": text, "add_special": False, "parse_special": special}).json()["tokens"]
            for text, special in cases]
    rows = []
    for (text, special), want in zip(cases, theirs):
        got = ours.encode(text, add_bos=False, special=special)
        row = {"text": text, "agree": got == want, "tokens": len(want)}
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            row.update(cadence=ours.decode(got[k:k + 3]), llama_cpp=ours.decode(want[k:k + 3]))
        rows.append(row)
        print(f"{'same' if got == want else 'APART'}: {len(want):3d} tokens  {text[:60]!r}"
              + ("" if got == want else f"  {row['cadence']!r} (cadence) / {row['llama_cpp']!r} (llama.cpp)"))
    print(f"{sum(r['agree'] for r in rows)}/{len(rows)} texts give the same ids")
    Path(OUT.value).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    app.run(main)
