"""Fill-in-the-middle: the prompt that asks a code model for the text between a prefix and a suffix.

Code models trained for infilling (Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder, Granite)
read three control tokens around the two sides of the hole, and some a repository's other files
before them:

    [FIM_REP]myproject\\n                    (where the vocabulary has FIM_REP)
    [FIM_SEP]path/a.py\\n  text of a.py      (one per extra file; without FIM_SEP, a snippet rule)
    [FIM_SEP]filename\\n                     (where it has FIM_SEP)
    [BOS]                                   (where the tokenizer adds one)
    [FIM_PRE]prefix + prompt [FIM_SUF]suffix [FIM_MID]

and write the middle after FIM_MID. This is llama.cpp's layout (llama-server's `/infill`, after
Qwen2.5-Coder's repository-level format), placeholders included, so a request means the same on
both servers. The document's texts are tokenized with special tokens spelled out, so code that
contains `<|fim_middle|>` is read as code; `prompt`, the middle's start, is read as a prompt is.
The tokens are found by their texts (llama.cpp's list, `tokenizer.FIM_TEXTS`), since GGUF files
rarely record them; the separators end generation (`tokenizer.end_of_generation`), so a middle
stops where the model starts another file.

Unlike llama-server, nothing is cut to fit a batch: a prompt longer than the context is refused
where every prompt is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cadence.checkpoints.tokenizer import FIM_TEXTS, Tokenizer

# llama.cpp's placeholders: the repository's name, and the current file's.
REPO_NAME = "myproject"
FILE_NAME = "filename"
# Between extra files, for a vocabulary without FIM_SEP.
SNIPPET_RULE = "\n\n--- snippet ---\n\n"


@dataclasses.dataclass(frozen=True)
class ExtraFile:
    """Another file of the repository, as context before the one being edited."""

    text: str
    filename: str = "tmp"


@dataclasses.dataclass(frozen=True)
class Hole:
    """What goes around the middle a request asks for, besides its prefix (the prompt)."""

    suffix: str
    prompt: str = ""  # the middle's start, after the prefix
    extra: tuple[ExtraFile, ...] | None = None  # the repository's other files (see infill_ids)

    def texts(self) -> list[str]:
        return [self.suffix, self.prompt, *(f.text + f.filename for f in self.extra or ())]


@dataclasses.dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FimTokens | None:
        """The vocabulary's infill tokens, or None where it lacks one of the three it needs."""
        found = {role: next((i for i in map(tokenizer.token_id, FIM_TEXTS[role]) if i is not None), None)
                 for role in ("prefix", "suffix", "middle", "repo", "file_sep")}
        if None in (found["prefix"], found["suffix"], found["middle"]):
            return None
        return cls(**found)


def missing_message(tokenizer: Tokenizer) -> str:
    """Why this vocabulary cannot infill: which of the three tokens it lacks."""
    lacks = [role for role in ("prefix", "suffix", "middle")
             if all(tokenizer.token_id(n) is None for n in FIM_TEXTS[role])]
    return (f"this model cannot fill in the middle: its vocabulary has no FIM {'/'.join(lacks)} "
            f"token (looked for {', '.join(FIM_TEXTS[lacks[0]][:3])}, ...)")


def infill_ids(tokenizer: Tokenizer, fim: FimTokens, prefix: str | Sequence[int], hole: Hole) -> list[int]:
    """The prompt's ids for filling in between `prefix` (text, or ids as they are) and the
    hole's suffix. With `hole.extra` (a tuple, even empty: llama-server's `/infill`), the
    repository-level layout above; without (None: OpenAI's `suffix`), the prefix, suffix and
    middle alone."""

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_bos=False, special=False)

    ids = []
    if hole.extra is not None:
        if fim.repo is not None:
            ids += [fim.repo, *text(REPO_NAME + "\n")]
        for file in hole.extra:
            ids += ([fim.file_sep, *text(file.filename + "\n")] if fim.file_sep is not None
                    else text(SNIPPET_RULE))
            ids += text(file.text)
        if fim.file_sep is not None:
            ids += [fim.file_sep, *text(FILE_NAME + "\n")]
    if tokenizer.add_bos:  # after the repository's files, where llama-server puts it
        ids.append(tokenizer.bos_id)
    ids.append(fim.prefix)
    ids += text(prefix) if isinstance(prefix, str) else prefix
    ids += tokenizer.encode(hole.prompt, add_bos=False) if hole.prompt else []
    return [*ids, fim.suffix, *text(hole.suffix), fim.middle]
