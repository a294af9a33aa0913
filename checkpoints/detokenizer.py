"""How token ids become text: per-token bytes, the shared byte stream, streaming deltas.

Contract:
- `byte_level_piece_bytes` / `sentencepiece_piece_bytes` give the raw bytes one vocabulary
  piece stands for; `Tokenizer` tabulates them once so `token_bytes` is a list lookup.
- `TokenByteStream` turns ids into the byte stream both `Tokenizer.decode` and
  `IncrementalDetokenizer` read (`Tokenizer.byte_stream` makes one over its tables), so the two
  agree byte for byte.
- `IncrementalDetokenizer(tokenizer).add(token_id)` returns the text that became final with
  this token, possibly "". It never returns part of a character: bytes of an incomplete UTF-8
  sequence wait until the sequence completes. A byte run that can no longer become a valid
  character turns into U+FFFD as soon as that is certain, never earlier. `flush()` ends the
  stream and turns a dangling partial sequence into U+FFFD. All deltas plus `flush()` equal
  `tokenizer.decode(ids, skip_special=skip_special)`. Special tokens named in `shown` are
  text even when the others are skipped (Mistral's [TOOL_CALLS], for the tool-call parser).
- `add` is O(1) per token: a table lookup and an incremental UTF-8 step; nothing is re-decoded.

Non-goals: stop-string matching (the scheduler holds text back for that), and transformers'
`clean_up_tokenization_spaces` post-processing.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Collection
from typing import Protocol

# Where a SentencePiece-style tokenizer inserted the dummy-prefix space that decode drops:
# nowhere, at the start of the text only, or also after every added token (tokenizer.model
# and Llama-2 "legacy" files restart the model on each span between added tokens).
PREFIX_NONE, PREFIX_FIRST, PREFIX_EACH = 0, 1, 2


def _gpt2_unicode_to_byte() -> dict[str, int]:
    # GPT-2 spells each byte as a printable character: printable Latin-1 bytes as themselves,
    # the other 68 bytes as U+0100 onwards, in byte order. This is the inverse map.
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()
_SPM_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_piece_bytes(piece: str) -> bytes:
    """Bytes of a byte-level BPE piece ("Ġthe" -> b" the")."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)
    except KeyError:  # outside the byte alphabet: only added tokens look like this
        return piece.encode("utf-8")


def sentencepiece_piece_bytes(piece: str, byte_fallback: bool) -> bytes:
    """Bytes of a SentencePiece piece ("▁the" -> b" the", "<0xE4>" -> b"\\xe4")."""
    m = _SPM_BYTE_PIECE.fullmatch(piece) if byte_fallback else None
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")


class TokenByteStream:
    """The bytes token ids contribute to decoded text, fed one id at a time.

    Made over a tokenizer's tables (`Tokenizer.byte_stream`): each id's bytes (`token_bytes`,
    which validates the id), the added and the special ids, and where the tokenizer put a
    dummy-prefix space (PREFIX_*). State is one flag: whether the next text token starts a run,
    where that space is dropped.
    """

    __slots__ = ("_token_bytes", "_added", "_special", "_space_mode", "_skip", "_shown", "_run_start")

    def __init__(self, token_bytes: Callable[[int], bytes], added_ids: Collection[int],
                 special: Collection[int], space_mode: int, *, skip_special: bool,
                 shown: Collection[int] = ()) -> None:
        self._token_bytes, self._added, self._special = token_bytes, added_ids, special
        self._space_mode, self._skip, self._run_start = space_mode, skip_special, True
        self._shown = frozenset(shown)  # special ids kept as text even when skipping the others

    def feed(self, token_id: int) -> bytes:
        data = self._token_bytes(token_id)  # validates the id
        if token_id in self._added or token_id in self._special:
            if self._space_mode == PREFIX_EACH and token_id in self._added:
                self._run_start = True  # encode restarted the model after this token
            skip = self._skip and token_id in self._special and token_id not in self._shown
            return b"" if skip else data
        if self._run_start and data:
            self._run_start = False
            if self._space_mode != PREFIX_NONE and data[:1] == b" ":
                return data[1:]
        return data


class ByteStreams(Protocol):
    """What a detokenizer needs of a tokenizer (`checkpoints.tokenizer.Tokenizer`)."""

    def byte_stream(self, *, skip_special: bool, shown: Collection[int] = ()) -> TokenByteStream: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are safe to send to a client."""

    def __init__(self, tokenizer: ByteStreams, *, skip_special: bool = True,
                 shown: Collection[int] = ()) -> None:
        self._bytes = tokenizer.byte_stream(skip_special=skip_special, shown=shown)
        # With final=False, errors="replace" holds back any prefix that may still complete and
        # replaces bytes only once no continuation can make them valid (b"\xe4" then b"A").
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the text that is now final (may be empty)."""
        data = self._bytes.feed(token_id)
        if not data:
            return ""
        delta = self._utf8.decode(data, final=False)
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Ends the stream; a dangling partial character becomes U+FFFD."""
        delta = self._utf8.decode(b"", final=True)
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far (joins new deltas once; repeated reads are O(1))."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def pending_bytes(self) -> int:
        """Bytes waiting for the rest of a character (0 when the text so far is complete)."""
        return len(self._utf8.getstate()[0])
