"""Tokenizer: text <-> token ids for Llama-family checkpoints, from GGUF or Hugging Face files.

Contract:
- One `Tokenizer` over two backends: a `tokenizers.Tokenizer` (byte-level BPE built from GGUF
  vocab + merges, or a byte-level / SentencePiece-style `tokenizer.json`) and a
  `sentencepiece` model (`tokenizer.model`, or a GGUF "llama" vocabulary rebuilt as one).
- Added tokens (e.g. `<|im_start|>`) written literally in text encode to their single id, as
  Hugging Face does; with `special=False` a special token's text is plain text, as in llama.cpp's
  `parse_special=false` (for a document's text, which must not inject control tokens). `encode` prepends BOS when `add_bos` asks for it, unless the ids already
  start with BOS (chat templates often write `bos_token` themselves).
- `decode` and the `IncrementalDetokenizer` share `TokenByteStream`, so streamed deltas add up
  to exactly `decode(ids)`; `decode(encode(s)) == s` for identity-normalizing tokenizers.
- `save(dir)` writes `tokenizer.json` or `tokenizer.model` plus `tokenizer_config.json`, from
  which `from_hf_dir(dir)` restores an identical tokenizer.
- Unusable files or input raise `TokenizerError` with a one-line message saying what to do.

Non-goals: WordPiece and GGUF "bert"/"t5"/"rwkv" vocabularies, Unicode normalizers beyond what
`tokenizer.json` declares, appending EOS, and transformers' `clean_up_tokenization_spaces`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Collection, Sequence

import sentencepiece
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from cadence.checkpoints import chat
from cadence.checkpoints.detokenizer import (PREFIX_EACH, PREFIX_FIRST, PREFIX_NONE, TokenByteStream,
                                     byte_level_piece_bytes, sentencepiece_piece_bytes)
from cadence.checkpoints.errors import TokenizerError


# tokenizer.ggml.pre values -> the pre-tokenizers of the models' own tokenizer.json, which
# llama.cpp names the same way (its regexes adapt these for its own engine): each regex splits
# every piece the one before it left ("isolated"), then ByteLevel maps the bytes, with GPT-2's
# regex where `gpt2_regex`. `digits` splits digits one by one first (StarCoder-style
# vocabularies; llama.cpp: "\p{N}", then the GPT-2 expression). `ignore_merges`: a piece the
# vocabulary holds whole is taken whole (Llama 3, Tekken). `add_bos`: llama.cpp's default where
# the file does not say.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken (Nemo, Small 3, Ministral): words split where case rises ("camelCase" ->
# "camel", "Case"), digits one by one, a run of symbols keeps trailing newlines and slashes.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_RE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class _Pre:
    splits: tuple[str, ...] = ()
    gpt2_regex: bool = False
    digits: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = _Pre(gpt2_regex=True)
# A file whose converter did not know its tokenizer: llama.cpp's fallback (runs of punctuation
# apart, then GPT-2's expression, digit runs, and those in threes), which it warns may degrade
# the output; cadence tokenizes such a file as llama.cpp does.
_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+",
                 r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                 r"\p{N}+", r"[0-9][0-9][0-9]"))
_STARCODER = _Pre(gpt2_regex=True, digits=True)
_LLAMA3 = _Pre((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = _Pre((_QWEN2_RE,))
_PRE = {
    "gpt2": _GPT2, "gpt-2": _GPT2, "default": _DEFAULT,
    "smollm": _STARCODER, "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3,
    "pixtral": _LLAMA3, "smaug-bpe": _Pre((_LLAMA3_RE,)),
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "tekken": _Pre((_TEKKEN_RE,), ignore_merges=True, add_bos=True),
}


def _pre_of(fields: dict[str, Any]) -> _Pre:
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} (cadence knows "
                             f"{', '.join(sorted(_PRE))}); load the model's tokenizer.json "
                             "with Tokenizer.from_hf_dir instead")
    return _PRE[pre]


def _gguf_bpe(fields: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    pre = _pre_of(fields)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated piece keeps its first id, as llama.cpp does
    # "left right": search from 1 so that a left side which is itself " " stays whole.
    merges = [(m[:k], m[k + 1:]) for m in fields.get("tokenizer.ggml.merges") or []
              for k in [m.find(" ", 1)] if k > 0]
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    # Control (3) and unknown (2) tokens are special, hence skippable; user-defined (4) ones
    # are ordinary text that BPE must still never split.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty in (2, 3)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == 4])
    return hf


# Each fill-in-the-middle role's token text across the code-model families, as llama.cpp
# recognizes them (`checkpoints.fim` lays prompts out with them).
FIM_TEXTS = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
               "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
               "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
               "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}
# A GGUF vocabulary records one EOS (and perhaps an EOT), but its model may end a turn or a
# document with another token (Qwen2.5: <|im_end|> and <|endoftext|>). llama.cpp ends generation
# at any of these texts; so does cadence, for the same file, where the token is a control token.
# (llama.cpp takes ordinary pieces too, such as Qwen's "</s>", which is HTML's strikethrough
# closing and must not end an answer.) A Hugging Face folder lists its own in
# generation_config.json.
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
             "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
             "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")


def end_of_generation(tokens: Sequence[str], types: Sequence[int]) -> list[str]:
    """The control tokens' texts among a GGUF vocabulary's `tokens` (`types` 3) that end
    generation, as llama.cpp reads the vocabulary."""
    present = {t for t, kind in zip(tokens, types) if kind == 3}
    return [t for t in END_TEXTS if t in present]


def fim_separators(special: Collection[str]) -> list[str]:
    """Among special tokens' texts, the first FIM pad, repository and file separator found:
    output that writes one is starting another file, so generation ends there (llama.cpp's
    rule, for every vocabulary here)."""
    firsts = [next((t for t in FIM_TEXTS[role] if t in special), None)
              for role in ("pad", "repo", "file_sep")]
    return [t for t in firsts if t is not None]


class Tokenizer:
    """Encodes and decodes one model's text. Build it with a `from_*` constructor."""

    def __init__(self, *, pieces: list[str], piece_bytes: list[bytes],
                 added: dict[int, tuple[str, bool]], special: set[int], bos: int | str | None,
                 eos: Sequence[int | str | None], add_bos: bool | None,
                 chat_template: str | None, space_mode: int, add_eos: bool | None = None,
                 hf: tokenizers.Tokenizer | None = None,
                 sp: sentencepiece.SentencePieceProcessor | None = None) -> None:
        self._hf, self._sp, self._space_mode, self._pieces = hf, sp, space_mode, pieces
        self._added = dict(sorted(added.items()))  # id -> (content, special): split from text
        self._added_ids = frozenset(added)
        self._special = frozenset(special | {i for i, (_, s) in added.items() if s})
        self.vocab_size: int = len(pieces)
        self._bytes = piece_bytes  # token_bytes is on the streaming path: keep it one lookup
        for i, (content, _) in self._added.items():
            self._bytes[i] = content.encode("utf-8")
        # No token spans more bytes than this, so a text of B bytes needs >= B / this tokens:
        # front doors refuse a prompt that cannot fit the context before tokenizing it.
        self.max_token_bytes: int = max((len(b) for b in self._bytes), default=1) or 1
        ids = {p: i for i, p in reversed(list(enumerate(pieces)))}
        self._added_by_text = {c: i for i, (c, _) in self._added.items()}
        ids.update(self._added_by_text)

        def resolve(t: int | str | None) -> int | None:
            if isinstance(t, str):
                return ids.get(t)
            return int(t) if t is not None and 0 <= int(t) < self.vocab_size else None

        self.bos_id: int | None = resolve(bos)
        special_texts = {c for i, (c, _) in self._added.items() if i in self._special}
        stops = [i for i in map(resolve, [*eos, *fim_separators(special_texts)]) if i is not None]
        self.eos_ids: frozenset[int] = frozenset(stops)
        self._eos_id = stops[0] if stops else None  # the template's eos_token
        self.add_bos: bool = bool(add_bos) and self.bos_id is not None
        # Whether the model's texts end with its EOS (tokenizer.ggml.add_eos_token, HF's
        # add_eos_token or post-processor: embedding models such as Qwen3-Embedding, pooled
        # at their last token): `with_eos`.
        self.add_eos: bool = bool(add_eos) and self._eos_id is not None
        self.chat_template: str | None = chat_template
        # More variables for every render (a server's --chat_template_kwargs), beneath a
        # request's own.
        self.chat_variables: dict[str, Any] = {}
        self._ids_by_text = ids
        self._split = self._splitter(special=True)
        self._split_plain = self._splitter(special=False)
        self._hf_plain: tokenizers.Tokenizer | None = None  # made when first needed

    def _splitter(self, special: bool) -> re.Pattern | None:
        """SentencePiece: the added tokens to cut out of text first (with `special`, all)."""
        alternatives = sorted({c for i, (c, _) in self._added.items()
                               if c and (special or i not in self._special)}, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") \
            if self._sp is not None and alternatives else None

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text's ids; `special=False`: special tokens written in it are spelled as text."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        if self._hf is not None:
            hf = self._hf if special else self._plain_hf()
            ids = hf.encode(text, add_special_tokens=False).ids
        else:
            ids = self._sp_encode(text, self._split if special else self._split_plain)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("this tokenizer has no BOS token; pass add_bos=False")
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def with_eos(self, ids: list[int]) -> list[int]:
        """An embedding's tokenized text as the model expects it: ending with its EOS where
        the tokenizer adds one (`add_eos`; never twice), as llama.cpp tokenizes it."""
        if self.add_eos and ids[-1:] != [self._eos_id]:
            return [*ids, self._eos_id]
        return ids

    def _plain_hf(self) -> tokenizers.Tokenizer:
        """A copy of the `tokenizers` backend that spells special tokens' texts out. (Two
        threads may both build it; either copy serves.)"""
        if self._hf_plain is None:
            plain = tokenizers.Tokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._hf_plain = plain
        return self._hf_plain

    def _sp_encode(self, text: str, split: re.Pattern | None) -> list[int]:
        if split is None:
            return self._sp.encode(text)
        ids: list[int] = []
        # SentencePiece would spell "<s>" out letter by letter, so added tokens are cut out
        # first; re.split with one group puts them at the odd indices. Each span between them
        # gets its own dummy prefix, as in transformers' LlamaTokenizer and llama.cpp.
        for k, part in enumerate(split.split(text)):
            if k % 2:
                ids.append(self._added_by_text[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False,
               shown: Collection[int] = ()) -> str:
        stream = self.byte_stream(skip_special=skip_special, shown=shown)
        return b"".join(stream.feed(i) for i in ids).decode("utf-8", errors="replace")

    def byte_stream(self, *, skip_special: bool, shown: Collection[int] = ()) -> TokenByteStream:
        """The bytes ids contribute to text, fed one at a time: what `decode` and the
        `IncrementalDetokenizer` read; special ids in `shown` are text even when skipping."""
        return TokenByteStream(self.token_bytes, self._added_ids, self._special, self._space_mode,
                               skip_special=skip_special, shown=shown)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text (piece, or added token's content) is `text`, if any."""
        return self._ids_by_text.get(text)

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer rendering chats with `template` instead (a request's own)."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            variables: dict[str, Any] | None = None) -> str:
        return chat.render_chat(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
                                variables={**self.chat_variables, **(variables or {})})

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token's text (its piece), or None."""
        return self._text_of(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token's text, the one templates write, or None."""
        return self._text_of(self._eos_id)

    def _text_of(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return self._added[token_id][0] if token_id in self._added else self._pieces[token_id]

    def __repr__(self) -> str:
        return (f"Tokenizer({'tokenizers' if self._hf else 'sentencepiece'}, "
                f"vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos})")

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes; `fields` maps metadata keys to decoded values."""
        tokens = list(fields.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens; load the "
                                 "model's tokenizer with Tokenizer.from_hf_dir instead")
        types = [int(t) for t in fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
        kw = dict(bos=fields.get("tokenizer.ggml.bos_token_id"),
                  eos=[fields.get("tokenizer.ggml.eos_token_id"),
                       fields.get("tokenizer.ggml.eot_token_id"),
                       fields.get("tokenizer.ggml.eom_token_id"), *end_of_generation(tokens, types)],
                  chat_template=fields.get("tokenizer.chat_template"),
                  add_eos=bool(fields.get("tokenizer.ggml.add_eos_token")))
        kind = fields.get("tokenizer.ggml.model")
        add_bos = fields.get("tokenizer.ggml.add_bos_token")
        if kind == "gpt2":  # llama.cpp's default for BPE vocabularies: no BOS, but Llama 3's and Tekken's
            hf = _gguf_bpe(fields, tokens, types)
            add_bos = _pre_of(fields).add_bos if add_bos is None else bool(add_bos)
            return cls._from_hf(hf, json.loads(hf.to_str()), add_bos=add_bos, **kw)
        if kind == "llama":  # llama.cpp's default for SentencePiece vocabularies: BOS
            proto = _spm_proto_from_gguf(fields, tokens, types)
            # llama.cpp cuts user-defined pieces out of the raw text first (Gemma's runs of
            # spaces, tabs and newlines, which SentencePiece, reading spaces as "▁", never meets).
            user = {i: (tokens[i], False) for i, t in enumerate(types) if t == 4}  # user-defined
            return cls._from_sp(proto, user, add_bos=add_bos is None or bool(add_bos), **kw)
        raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r} (cadence reads 'gpt2' "
                             "and 'llama'); load the model's Hugging Face tokenizer with "
                             "Tokenizer.from_hf_dir instead")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json (preferred) or tokenizer.model and the config files beside it."""
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path} is not a folder; pass the model folder that holds "
                                 "tokenizer.json or tokenizer.model")
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        gen_eos = gen.get("eos_token_id")  # generation stops on any of: an int or a list
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = [_token_text(cfg.get("eos_token", smap.get("eos_token"))),
               *cfg.get("eos_token_ids", []), *gen_eos]
        bos = _token_text(cfg.get("bos_token", smap.get("bos_token"))) or gen.get("bos_token_id")
        kw = dict(bos=bos, eos=eos, chat_template=template, add_bos=cfg.get("add_bos_token"),
                  add_eos=cfg.get("add_eos_token"))
        try:
            if (path / "tokenizer.json").is_file():
                text = (path / "tokenizer.json").read_text(encoding="utf-8")
                return cls._from_hf(tokenizers.Tokenizer.from_str(text), json.loads(text), **kw)
            if (path / "tokenizer.model").is_file():
                extra = {int(k): (v["content"], bool(v.get("special")))
                         for k, v in cfg.get("added_tokens_decoder", {}).items()}
                kw["add_bos"] = kw["add_bos"] is None or kw["add_bos"]  # LlamaTokenizer's default
                return cls._from_sp((path / "tokenizer.model").read_bytes(), extra, **kw)
        except TokenizerError:
            raise
        except Exception as e:  # noqa: BLE001 - tokenizers/sentencepiece raise bare Exception
            raise TokenizerError(f"the tokenizer files in {path} do not load ({e}); "
                                 "re-download them") from e
        raise TokenizerError(f"{path} has neither tokenizer.json nor tokenizer.model; copy the "
                             "model's tokenizer files there (or load the tokenizer from its GGUF)")

    @classmethod
    def _from_hf(cls, hf: tokenizers.Tokenizer, spec: dict, *, add_bos: bool | None,
                 add_eos: bool | None = None, **kw: Any) -> Tokenizer:
        style, space_mode = _classify_tokenizer_json(spec)
        pieces = [hf.id_to_token(i) or "" for i in range(hf.get_vocab_size(with_added_tokens=True))]
        piece_bytes = [byte_level_piece_bytes(p) if style == "byte_level"
                       else sentencepiece_piece_bytes(p, style == "spm_bytes") for p in pieces]
        added = {i: (t.content, t.special) for i, t in hf.get_added_tokens_decoder().items()}
        tok = cls(pieces=pieces, piece_bytes=piece_bytes, added=added, special=set(),
                  add_bos=False, space_mode=space_mode, hf=hf, **kw)
        # No add_bos_token or add_eos_token in the config (Llama 3's BOS, Qwen3-Embedding's
        # EOS): the post-processor says.
        marked = hf.encode("a", add_special_tokens=True).ids
        if add_bos is None and tok.bos_id is not None:
            add_bos = marked[:1] == [tok.bos_id]
        tok.add_bos = bool(add_bos) and tok.bos_id is not None
        if add_eos is None and tok._eos_id is not None:
            add_eos = marked[-1:] == [tok._eos_id]
        tok.add_eos = bool(add_eos) and tok._eos_id is not None
        return tok

    @classmethod
    def _from_sp(cls, proto: bytes, extra: dict[int, tuple[str, bool]], **kw: Any) -> Tokenizer:
        sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        n = sp.get_piece_size()
        size = max([n, *(i + 1 for i in extra)])  # added tokens may extend the vocabulary
        pieces = [sp.id_to_piece(i) for i in range(n)] + [""] * (size - n)
        piece_bytes = [sentencepiece_piece_bytes(pieces[i], sp.is_byte(i)) for i in range(n)]
        piece_bytes += [b""] * (size - n)
        # Control and unknown pieces are cut out of text by us; user-defined ones SentencePiece
        # matches itself.
        added = {i: (pieces[i], True) for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
        added.update(extra)
        from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf: import on use

        spec = pb.ModelProto.FromString(proto)
        mode = PREFIX_EACH if spec.normalizer_spec.add_dummy_prefix else PREFIX_NONE
        return cls(pieces=pieces, piece_bytes=piece_bytes, added=added, space_mode=mode, sp=sp,
                   special={i for i in range(n) if sp.is_unused(i)}, **kw)

    def save(self, directory: str | Path) -> None:
        """Writes tokenizer.json or tokenizer.model, and tokenizer_config.json, to directory."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        keep = "tokenizer.json" if self._hf is not None else "tokenizer.model"
        for stale in {"tokenizer.json", "tokenizer.model", "chat_template.jinja"} - {keep}:
            (d / stale).unlink(missing_ok=True)  # from_hf_dir would read them instead of ours
        if self._hf is not None:
            self._hf.save(str(d / keep))
        else:
            (d / keep).write_bytes(self._sp.serialized_model_proto())
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast" if self._hf else "LlamaTokenizer",
               "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
               "bos_token": self.bos_token,
               "eos_token": self.eos_token,
               "eos_token_ids": sorted(self.eos_ids),  # cadence's key: every stop id
               "chat_template": self.chat_template,
               "added_tokens_decoder": {str(i): {"content": c, "special": s}
                                        for i, (c, s) in self._added.items()}}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2),
                                                encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); re-download or delete it") from e


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken.
    return value.get("content") if isinstance(value, dict) else value


def _parts(node: dict | None, nested: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get(nested, []) for p in _parts(child, nested)]
    return [node]


def _classify_tokenizer_json(spec: dict) -> tuple[str, int]:
    """(piece style, dummy-prefix mode) of a tokenizer.json; raises if cadence can't read it."""
    model = spec.get("model", {}).get("type")
    dec = {d.get("type") for d in _parts(spec.get("decoder"), "decoders")}
    if model in ("BPE", "Unigram") and "ByteLevel" in dec:
        return "byte_level", PREFIX_NONE
    if model in ("BPE", "Unigram") and dec & {"ByteFallback", "Metaspace", "Replace"}:
        style = "spm_bytes" if "ByteFallback" in dec else "spm"
        if any(n.get("type") == "Prepend" for n in _parts(spec.get("normalizer"), "normalizers")):
            return style, PREFIX_EACH  # Llama-2 "legacy": "▁" before every span
        for p in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
            if p.get("type") == "Metaspace":
                scheme = p.get("prepend_scheme", "always" if p.get("add_prefix_space", True)
                               else "never")
                # The Metaspace decoder strips only the very first space; match it.
                return style, PREFIX_NONE if scheme == "never" else PREFIX_FIRST
        return style, PREFIX_NONE
    raise TokenizerError(f"tokenizer.json has a {model} model with decoders {sorted(map(str, dec))}"
                         "; cadence reads byte-level BPE and SentencePiece-style tokenizers only")


def _spm_proto_from_gguf(fields: dict[str, Any], tokens: list[str], types: list[int]) -> bytes:
    """A SentencePiece BPE model holding a GGUF "llama" vocabulary.

    llama.cpp merges the adjacent pair whose joined piece scores highest; SentencePiece's BPE
    encoder does the same, so the rebuilt model tokenizes as llama.cpp does.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError("a GGUF 'llama' vocabulary needs tokenizer.ggml.scores, one per "
                             "token; load the model's tokenizer.model with from_hf_dir instead")
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = 6 in types
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    for i, (piece, score, ty) in enumerate(zip(tokens, scores, types)):
        ty = 2 if i == unk else ty if 1 <= ty <= 6 else 1  # 0 (undefined) -> normal
        m.pieces.add(piece=piece, score=float(score), type=ty)
    if sum(p.type == 2 for p in m.pieces) != 1:
        raise TokenizerError("a GGUF 'llama' vocabulary needs exactly one unknown token (type 2)"
                             " for SentencePiece; load its tokenizer.model with from_hf_dir")
    return m.SerializeToString()
