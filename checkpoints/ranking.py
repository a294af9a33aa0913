"""A reranker's head: how a model that ranks documents for a query scores one pair.

    head = RankingHead.from_gguf(fields, tensors, path)   # None: the file is no reranker
    ids = head.prompt(tokenizer, query, document)          # the pair as the model reads it
    score = head.score(hidden)                             # hidden: the last token's final
                                                           # hidden state (the last norm's output)
    files["ranking.npz"] = head.file_bytes(); RankingHead.load(folder)   # in a converted checkpoint

llama.cpp's converter writes a reranker as its language model plus what it ranks with: the
pooling type "rank", a classification head `cls.output` ([labels, hidden], with a bias where
the source had one) and a prompt template named "rerank" with `{query}` and `{document}` in it.
Qwen3-Reranker's head is the language model's rows for "yes" and "no", and its score the
probability of "yes" over the two; llama.cpp takes the softmax for Qwen3 only, and otherwise
reports the head's first output as it is. So does cadence. A file without the template has the
pair laid out as llama.cpp does then: BOS, the query, EOS, the document, EOS (BOS and EOS where
the tokenizer adds them; llama.cpp's SEP, which no decoder's tokenizer adds, is left out).

The score reads the same pooled hidden state an embedding does (`GenerationParams.pooling`
"last"); the head, a few thousand numbers, is applied on the host in float64.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.tokenizer import Tokenizer

FILE = "ranking.npz"  # in a converted checkpoint's folder
SOFTMAX_ARCHITECTURES = ("qwen3", "qwen3vl")  # llama.cpp's: the head's outputs as a softmax


@dataclasses.dataclass(frozen=True)
class RankingHead:
    weight: np.ndarray  # [labels, hidden]
    bias: np.ndarray | None  # [labels]
    softmax: bool  # the score: the first label's probability over all; else its output as it is
    template: str | None = None  # the pair's prompt, `{query}` and `{document}` in it
    labels: tuple[str, ...] = ()

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], tensors: dict[str, np.ndarray], path: str | Path) -> RankingHead | None:
        """A GGUF's head, where it has one (`cls.output.weight`); None where it has none.
        `tensors`: its `cls.*` tensors by name, as float arrays (`checkpoints.gguf.load_ranking`)."""
        if "cls.output.weight" not in tensors:
            return None
        if "cls.weight" in tensors:
            raise CheckpointError(f"{path}: a classification head with a dense layer before its output "
                                  "(cls.weight, BERT's) is not supported; cadence ranks with "
                                  "cls.output alone, as llama.cpp's decoder rerankers have it")
        weight = np.asarray(tensors["cls.output.weight"], np.float32)
        bias = tensors.get("cls.output.bias")
        arch = fields.get("general.architecture")
        labels = fields.get(f"{arch}.classifier.output_labels") or ()
        return cls(np.ascontiguousarray(weight.reshape(-1, weight.shape[-1])),
                   None if bias is None else np.asarray(bias, np.float32).reshape(-1),
                   arch in SOFTMAX_ARCHITECTURES, fields.get("tokenizer.chat_template.rerank"),
                   tuple(str(label) for label in labels))

    def prompt(self, tokenizer: Tokenizer, query: str, document: str) -> list[int]:
        """The pair's token ids, as llama-server lays them out."""
        if self.template is not None:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return tokenizer.encode(text, add_bos=False)
        return (tokenizer.with_eos(tokenizer.encode(query, add_bos=None, special=False))
                + tokenizer.with_eos(tokenizer.encode(document, add_bos=False, special=False)))

    def score(self, hidden: np.ndarray) -> float:
        """The pair's score from its last token's final hidden state."""
        out = self.weight.astype(np.float64) @ np.asarray(hidden, np.float64)
        if self.bias is not None:
            out = out + self.bias
        if self.softmax:
            out = np.exp(out - out.max())
            out = out / out.sum()
        return float(out[0])

    def file_bytes(self) -> bytes:
        buffer = io.BytesIO()
        meta = {"softmax": self.softmax, "template": self.template, "labels": list(self.labels)}
        arrays = {"weight": self.weight, **({} if self.bias is None else {"bias": self.bias})}
        np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        return buffer.getvalue()

    @classmethod
    def load(cls, folder: str | Path) -> RankingHead | None:
        """A converted checkpoint's head, or None where it has none."""
        path = Path(folder) / FILE
        if not path.is_file():
            return None
        with np.load(path) as kept:
            meta = json.loads(kept["meta"].tobytes())
            return cls(kept["weight"], kept["bias"] if "bias" in kept else None, meta["softmax"],
                       meta["template"], tuple(meta["labels"]))
