"""cadence's GGUF pre-tokenizers against llama.cpp's: the same token ids for the same text.

    python bench/results/pretokenizers-cpu/parity.py --llama_server=<llama-server> \
        --tokenizer_from=<Qwen2.5's GGUF> --out=bench/results/pretokenizers-cpu/parity.json

A GGUF's byte-level BPE vocabulary is pre-tokenized by the regexes its `tokenizer.ggml.pre` names
(`checkpoints/tokenizer.py`). For each name cadence knows, a one-layer model of random weights
carrying Qwen2.5's vocabulary and merges under that name goes to llama-server, and every text of
`TEXTS` to its /tokenize (no BOS, control-token text not parsed) and to cadence's tokenizer built
from the same file. One vocabulary serves every name: the splits decide which merges can apply,
so a wrong split shows as different ids. Qwen2.5's vocabulary holds single digits only, so the
file adds every two- and three-digit number as a token with its merges: digit runs then come
out in the groups a pre-tokenizer cuts them into. Reported per name: the texts whose ids agree,
and for each that does not, the first differing piece on each side.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import gguf
import httpx
from absl import app, flags

from cadence.bench.cadence_server import serving
from cadence.bench.random_gguf import write_random_gguf
from cadence.checkpoints.gguf_file import read_gguf
from cadence.checkpoints.tokenizer import _PRE, Tokenizer
from cadence.model.config import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from texts import TEXTS  # noqa: E402

SERVER = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary", required=True)
SOURCE = flags.DEFINE_string("tokenizer_from", None, "a Qwen2.5 GGUF whose vocabulary to use", required=True)
OUT = flags.DEFINE_string("out", None, "where to write the JSON results", required=True)

CONFIG = ModelConfig(name="pre-parity", vocab_size=151936, hidden_size=256, num_layers=1, num_heads=4,
                     num_kv_heads=4, head_dim=64, ffn_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                     tie_embeddings=True, max_context=512)


def vocabulary(pre: str):
    """`write_random_gguf`'s `metadata`: Qwen2.5's tokenizer keys, pre-tokenized as `pre`, with
    the numbers 00-999 as tokens (appended, "1" + "2" -> "12", "12" + "3" -> "123")."""
    fields = read_gguf(SOURCE.value)[0]
    tokens, merges = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.merges"])
    known = set(tokens)
    for n in [f"{a}{b}" for a in range(10) for b in range(10)] + [f"{a}{b:02d}" for a in range(10) for b in range(100)]:
        if n not in known:
            tokens.append(n)
            merges.append(f"{n[:-1]} {n[-1]}")
    types = list(fields["tokenizer.ggml.token_type"]) + [1] * (len(tokens) - len(fields["tokenizer.ggml.tokens"]))

    def add(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    return add, len(tokens)


def main(argv: list[str]) -> None:
    del argv
    work = Path(tempfile.mkdtemp(prefix="pre-parity-"))
    rows = {}
    for i, pre in enumerate(sorted(_PRE)):
        path = work / f"{pre}.gguf"
        metadata, size = vocabulary(pre)
        write_random_gguf(path, dataclasses.replace(CONFIG, vocab_size=size), "qwen2", metadata)
        ours = Tokenizer.from_gguf_fields(read_gguf(path)[0])
        port = 8940 + i
        try:
            with serving([SERVER.value, "-m", str(path), "--port", str(port), "-c", "512", "-np", "1",
                          "-t", "2"], port) as base:
                theirs = [httpx.post(f"{base}/tokenize", timeout=60, json={
                    "content": text, "add_special": False, "parse_special": False}).json()["tokens"]
                    for text in TEXTS]
        except RuntimeError:  # a name llama.cpp does not know (cadence's own alias)
            rows[pre] = {"llama_cpp": "refuses the file: it does not know this name"}
            print(f"{pre:>16}: llama.cpp refuses the name")
            continue
        apart = []
        for text, want in zip(TEXTS, theirs):
            got = ours.encode(text, add_bos=False, special=False)
            if got != want:
                k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                piece = (lambda ids: ours.decode(ids[k:k + 3]))  # noqa: E731
                apart.append({"text": text, "cadence": piece(got), "llama_cpp": piece(want)})
        rows[pre] = {"texts": len(TEXTS), "agree": len(TEXTS) - len(apart), "apart": apart}
        print(f"{pre:>16}: {len(TEXTS) - len(apart)}/{len(TEXTS)} texts give the same ids"
              + "".join(f"\n{'':>18}{a['cadence']!r} (cadence) / {a['llama_cpp']!r} (llama.cpp)"
                        for a in apart))
    Path(OUT.value).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    app.run(main)
