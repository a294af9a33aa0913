"""Tokenizer, detokenizer and chat-template tests on tokenizers trained here, in seconds.

A byte-level BPE is trained with the `tokenizers` trainer and exported as GGUF-style metadata;
a SentencePiece BPE with byte fallback is trained with `sentencepiece`. No network, no files
outside tmp_path (`tests/trained_tokenizers.py`; the SentencePiece fixtures are conftest's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from cadence.checkpoints import chat
from cadence.checkpoints.detokenizer import IncrementalDetokenizer
from cadence.checkpoints.tokenizer import Tokenizer, TokenizerError
from tests.trained_tokenizers import SMOLLM2_TEMPLATE, SPECIALS, gguf_fields, trained_bpe

SAMPLES = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\nmixed  \t  runs",
    "digits 0123456789 and 3.14159 and -42",
    "Crème brûlée, Ångström, naïve café in Zürich",
    "中文字符和日本語のテキスト，한국어",
    "emoji 🎉🚀 👩‍👩‍👧 🦜 flags 🇫🇷",
    "mixed: x=1; y='two'; z=\"three\" # comment ™ ∑",
    "",
]


@pytest.fixture(scope="session")
def hf_bpe() -> tokenizers.Tokenizer:
    return trained_bpe()


@pytest.fixture(scope="session")
def bpe(hf_bpe) -> Tokenizer:
    return Tokenizer.from_gguf_fields(gguf_fields(hf_bpe, "smollm"))


# --- byte-level BPE built from GGUF metadata ---------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_ids_match_the_trained_tokenizer(bpe, hf_bpe):
    for text in SAMPLES + ["<|im_start|>user\nHi there<|im_end|>\n"]:
        assert bpe.encode(text) == hf_bpe.encode(text, add_special_tokens=False).ids, text


def test_bpe_attributes(bpe, hf_bpe):
    vocab = hf_bpe.get_vocab()
    assert bpe.vocab_size == len(vocab)
    assert bpe.bos_id == vocab["<|im_start|>"] and not bpe.add_bos
    assert bpe.eos_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert bpe.chat_template == SMOLLM2_TEMPLATE
    assert all(bpe.is_special(vocab[s]) for s in SPECIALS)
    assert not bpe.is_special(bpe.encode("The")[0])
    assert bpe.encode("hi", add_bos=True)[0] == bpe.bos_id


def test_smollm_splits_digits_one_by_one(bpe):
    ids = bpe.encode("x 1234567890")
    digits = [bpe.token_bytes(i) for i in ids if bpe.token_bytes(i).strip().isdigit()]
    assert digits == [bytes([c]) for c in b"1234567890"]


def test_special_tokens_in_text_are_single_ids(bpe):
    start, end = bpe.encode("<|im_start|>"), bpe.encode("<|im_end|>")
    assert len(start) == len(end) == 1
    ids = bpe.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == start[0] and end[0] in ids
    assert bpe.decode(ids, skip_special=True) == "user\nHi\n"
    assert bpe.token_bytes(start[0]) == b"<|im_start|>"
    # A special token that is `shown` is text while the others are skipped, streamed or not.
    assert bpe.decode(ids, skip_special=True, shown=end) == "user\nHi<|im_end|>\n"
    detok = IncrementalDetokenizer(bpe, shown=end)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "user\nHi<|im_end|>\n"


def test_token_bytes_undo_the_byte_map(bpe):
    text = "é中🎉 x"
    assert b"".join(bpe.token_bytes(i) for i in bpe.encode(text)) == text.encode()
    # Every byte of the alphabet is one token whose bytes are that byte.
    single = {bpe.token_bytes(i) for i in range(bpe.vocab_size) if len(bpe.token_bytes(i)) == 1}
    assert single == {bytes([b]) for b in range(256)}


@pytest.mark.parametrize("pre, groups", [("llama3", [3, 3, 1]), ("qwen2", [1] * 7),
                                         ("gpt2", None)])
def test_pre_tokenizer_digit_grouping(hf_bpe, pre, groups):
    tok = Tokenizer.from_gguf_fields(gguf_fields(hf_bpe, pre))
    assert tok.decode(tok.encode("x 1234567 y's")) == "x 1234567 y's"
    if groups is not None:  # every token boundary must fall on a group boundary
        ends, n = set(), 0
        for i in tok.encode("1234567"):
            n += len(tok.token_bytes(i))
            ends.add(n)
        assert {sum(groups[:k + 1]) for k in range(len(groups))} <= ends


@pytest.mark.parametrize("pre, text, pieces", [
    # Tekken (Mistral Nemo): words split where case rises, digits alone, "/" kept on a symbol run.
    ("tekken", "getElementById 123 a//b", ["get", "Element", "By", "Id", " ", "1", "2", "3", " a", "//", "b"]),
    ("llama-bpe", "getElementById 1234 I'M", ["getElementById", " ", "123", "4", " I", "'M"]),
    ("qwen2", "x 1234", ["x", " ", "1", "2", "3", "4"]),
    # StarCoder's, which llama.cpp gives "refact" and "command-r" too: digits alone.
    *[(pre, "x 12 y's", ["x", " ", "1", "2", " y", "'s"]) for pre in ("starcoder", "refact", "command-r")],
    # llama.cpp's fallback for a tokenizer its converter did not know: punctuation runs apart.
    ("default", "we'll see; 1234", ["we", "'", "ll", " see", ";", " ", "123", "4"]),
])
def test_gguf_pre_tokenizers_split_as_the_models_own(hf_bpe, pre, text, pieces):
    """A GGUF's pre-tokenizer by its tokenizer.ggml.pre name, as the model's tokenizer.json
    splits text (bench/results/pretokenizers-cpu: every name gives llama.cpp's token ids)."""
    tok = Tokenizer.from_gguf_fields(gguf_fields(hf_bpe, pre))
    split = tok._hf.pre_tokenizer.pre_tokenize_str(text)
    byte_decoder = decoders.ByteLevel()
    assert [byte_decoder.decode([piece]) for piece, _ in split] == pieces
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("pre, recorded, want", [("llama-bpe", None, True), ("tekken", None, True),
                                                 ("qwen2", None, False), ("llama-bpe", False, False)])
def test_a_gguf_without_add_bos_takes_llama_cpps_default_for_its_pre_tokenizer(hf_bpe, pre, recorded, want):
    fields = {**gguf_fields(hf_bpe, pre), "tokenizer.ggml.add_bos_token": recorded}
    if recorded is None:
        del fields["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_gguf_fields(fields)
    assert tok.add_bos is want and (tok.encode("hi")[0] == tok.bos_id) is want


def test_unsupported_gguf_tokenizers_raise(hf_bpe):
    with pytest.raises(TokenizerError, match="smollm"):
        Tokenizer.from_gguf_fields(gguf_fields(hf_bpe, "no-such-pre"))
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_fields({**gguf_fields(hf_bpe, "gpt2"), "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2"})


def _assert_same(a: Tokenizer, b: Tokenizer) -> None:
    for attr in ("vocab_size", "bos_id", "eos_ids", "add_bos", "chat_template"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for text in SAMPLES + ["<|im_start|>user\nHi<|im_end|>"]:
        ids = a.encode(text)
        assert b.encode(text) == ids and b.decode(ids) == a.decode(ids)
    assert all(a.token_bytes(i) == b.token_bytes(i) and a.is_special(i) == b.is_special(i)
               for i in range(a.vocab_size))
    messages = [{"role": "user", "content": "Hi"}]
    assert a.apply_chat_template(messages) == b.apply_chat_template(messages)


def test_bpe_save_and_restore(bpe, tmp_path):
    bpe.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    _assert_same(bpe, Tokenizer.from_hf_dir(tmp_path))


def test_hf_dir_config_files(hf_bpe, tmp_path):
    """Llama-3 style folder: BOS comes from the post-processor, stop ids from generation_config."""
    vocab = hf_bpe.get_vocab()
    hf = tokenizers.Tokenizer.from_str(hf_bpe.to_str())
    hf.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", vocab["<|im_start|>"])])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "D"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos and tok.bos_id == vocab["<|im_start|>"] and tok.chat_template == "D"
    assert tok.eos_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert tok.encode("hi") == [tok.bos_id, *tok.encode("hi", add_bos=False)]
    assert tok.encode("<|im_start|>hi").count(tok.bos_id) == 1  # template already wrote BOS


def test_bad_files_and_input_raise(bpe, tmp_path):
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a folder"):
        Tokenizer.from_hf_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match="do not load"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        bpe.decode([0, bpe.vocab_size])
    with pytest.raises(TokenizerError, match="str"):
        bpe.encode(b"bytes")
    assert issubclass(TokenizerError, ValueError)


# --- SentencePiece -------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_spm_round_trip(spm, sp_dir, text):
    ids = spm.encode(text)
    assert ids[0] == spm.bos_id == 1 and spm.add_bos
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert ids[1:] == sp.encode(text)
    assert spm.decode(ids, skip_special=True) == text
    assert spm.decode(ids) == "<s>" + text
    assert spm.encode(text, add_bos=False) == ids[1:]


def test_spm_byte_fallback_for_unseen_emoji(spm):
    ids = spm.encode("a 🦜", add_bos=False)
    assert [spm.token_bytes(i) for i in ids[-4:]] == [bytes([b]) for b in "🦜".encode()]
    assert spm.decode(ids) == "a 🦜"


def test_spm_control_tokens_and_eos(spm):
    ids = spm.encode("<|im_start|>user\nHi<|im_end|>", add_bos=False)
    start, end = spm.encode("<|im_start|>", add_bos=False), spm.encode("<|im_end|>", add_bos=False)
    assert len(start) == len(end) == 1 and ids[0] == start[0] and ids[-1] == end[0]
    assert spm.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert spm.eos_ids == {2} and spm.is_special(2) and spm.token_bytes(2) == b"</s>"


def test_spm_from_gguf_fields_encodes_the_same(spm, sp_dir):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    fields = {"tokenizer.ggml.model": "llama",
              "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
              "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_gguf_fields(fields)
    for text in SAMPLES + ["<|im_start|>user\nHi<|im_end|>"]:
        assert tok.encode(text) == spm.encode(text), text
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_spm_from_gguf_cuts_user_defined_pieces_out_of_the_raw_text(sp_dir):
    """Gemma's vocabulary holds runs of spaces and tabs as user-defined pieces written with
    real spaces, which SentencePiece (reading spaces as "▁") never meets: as llama.cpp does,
    they are cut out of the text first, longest first, and each span between is encoded alone."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    n = sp.get_piece_size()
    runs = ["  ", "   ", "\t\t"]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_space_prefix": False,
              "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)] + runs,
              "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)] + [-1000.0] * 3,
              "tokenizer.ggml.token_type": [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6
                                            if sp.is_byte(i) else 1 for i in range(n)] + [4] * 3,
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_gguf_fields(fields)
    plain = lambda text: tok.encode(text, add_bos=False)  # noqa: E731
    for special in (True, False):  # ordinary text: cut out whether or not specials are parsed
        assert tok.encode("def f():\n    return", add_bos=False, special=special) == (
            plain("def f():\n") + [n + 1] + plain(" return"))
    assert plain("a  b\t\tc") == plain("a") + [n] + plain("b") + [n + 2] + plain("c")
    text = "x     y\t\t\tz"
    assert tok.decode(plain(text)) == text and not tok.is_special(n)


def test_spm_save_and_restore(spm, tmp_path):
    spm.save(tmp_path)
    assert (tmp_path / "tokenizer.model").is_file()
    _assert_same(spm, Tokenizer.from_hf_dir(tmp_path))


def _spm_style_json(sp_dir: Path, folder: Path, scheme: str | None) -> tokenizers.Tokenizer:
    """A SentencePiece-style tokenizer.json (Unigram + byte fallback) over the trained pieces."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    hf = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if scheme is None:  # Llama-2 "legacy": normalizer prepends "▁" to every span
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                              normalizers.Replace(" ", "\u2581")])
        hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)
        hf.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme=scheme, split=False),
                                        decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return hf


@pytest.mark.parametrize("scheme", [None, "first", "always"])
def test_spm_style_tokenizer_json(sp_dir, tmp_path, scheme):
    hf = _spm_style_json(sp_dir, tmp_path, scheme)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_id == 1 and tok.eos_ids == {2} and not tok.add_bos  # no post-processor
    for text in SAMPLES + ["x <|im_start|>user\nHi<|im_end|> y"]:
        ids = tok.encode(text)
        if scheme is None:  # a prepend per span is exactly invertible
            assert tok.decode(ids) == text
        else:  # Metaspace is lossy on leading spaces; decode exactly as its decoder does
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


# --- incremental detokenizer --------------------------------------------------------------


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_deltas_concatenate_to_decode(request, which, skip_special):
    tok = request.getfixturevalue(which)
    ids = tok.encode("<|im_start|>user\n" + "\n".join(SAMPLES) + "<|im_end|>\n")
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas)  # valid text never shows a broken char
    assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special=skip_special)
    assert detok.text == tok.decode(ids, skip_special=skip_special)


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    by_bytes = {tok.token_bytes(i): i for i in range(tok.vocab_size)
                if len(tok.token_bytes(i)) == 1}
    return [by_bytes[bytes([b])] for b in data]


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_emoji_split_over_four_byte_tokens(request, which):
    tok = request.getfixturevalue(which)
    detok = IncrementalDetokenizer(tok)
    first = detok.add(tok.encode("ok", add_bos=False)[0])
    outs = [detok.add(i) for i in _byte_ids(tok, "🦜".encode())]
    assert outs == ["", "", "", "🦜"] and detok.pending_bytes == 0
    assert detok.flush() == "" and detok.text == first + "🦜"


def test_valid_text_fed_byte_by_byte_never_shows_a_broken_character(bpe):
    text = "".join(SAMPLES)
    detok = IncrementalDetokenizer(bpe)
    deltas = [detok.add(i) for i in _byte_ids(bpe, text.encode())]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_flush_replaces_a_dangling_partial_character(bpe):
    detok = IncrementalDetokenizer(bpe)
    assert [detok.add(i) for i in _byte_ids(bpe, "🦜".encode()[:2])] == ["", ""]
    assert detok.pending_bytes == 2
    assert detok.flush() == "\ufffd" and detok.text == "\ufffd"


def test_invalid_bytes_are_replaced_once_proven_invalid(bpe):
    detok = IncrementalDetokenizer(bpe)
    lead, letter, ff = _byte_ids(bpe, b"\xe4A\xff")
    assert detok.add(lead) == ""               # could still become a CJK character
    assert detok.add(letter) == "\ufffdA"      # 'A' proves it cannot
    assert detok.add(ff) == "\ufffd"           # 0xFF never starts a character
    assert bpe.decode([lead, letter, ff]) == detok.text


def test_special_tokens_are_skipped_by_default(bpe):
    ids = bpe.encode("<|im_start|>assistant\nHi!<|im_end|>")
    detok = IncrementalDetokenizer(bpe)
    assert "".join(detok.add(i) for i in ids) == "assistant\nHi!"


def test_spm_stream_drops_the_dummy_prefix_once(spm):
    detok = IncrementalDetokenizer(spm)
    assert "".join(detok.add(i) for i in spm.encode("Hello world")) == "Hello world"


# --- chat templates -----------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chatml_fallback(spm):
    assert spm.chat_template is None
    assert spm.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n")
    no_prompt = spm.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert no_prompt.endswith("Hi!<|im_end|>\n")


def test_smollm2_template_adds_default_system_prompt(bpe):
    prompt = bpe.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert bpe.apply_chat_template(CONVERSATION).startswith("<|im_start|>system\nBe brief.")
    assert bpe.encode(prompt)[0] == bpe.bos_id


@pytest.mark.parametrize("messages", [
    [], "hello", [{"role": "user"}], [{"content": "hi"}], [{"role": "", "content": "hi"}],
    [{"role": "user", "content": ["a", "b"]}], [{"role": "user", "content": None}], ["hi"],
])
def test_bad_messages_raise(bpe, messages):
    with pytest.raises(TokenizerError, match="messages"):
        bpe.apply_chat_template(messages)


def test_template_errors_become_tokenizer_errors(hf_bpe):
    fields = gguf_fields(hf_bpe, "smollm")
    strict = Tokenizer.from_gguf_fields({**fields, "tokenizer.chat_template": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{% endfor %}")})
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    with pytest.raises(TokenizerError, match="no tools here"):
        strict.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = Tokenizer.from_gguf_fields({**fields, "tokenizer.chat_template": "{% for %}"})
    with pytest.raises(TokenizerError, match="does not parse"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_gguf_vocabulary_ends_generation_where_llama_cpp_does(tiny_config):
    """GGUF files record one EOS (and maybe an EOT); the other control tokens that end a turn, a
    document or a file (`<|endoftext|>`, FIM separators) stop generation too, by their texts.
    An ordinary piece with such a text does not."""
    from tests.conftest import fim_tokenizer_of, tiny_tokenizer_fields

    fields = tiny_tokenizer_fields(tiny_config)
    del fields["tokenizer.ggml.eot_token_id"]
    tokens = list(fields["tokenizer.ggml.tokens"])
    end = tokens.index("<|endoftext|>")
    # An ordinary piece spelled "</s>" (Qwen's vocabulary has one: HTML's closing tag).
    plain = next(i for i, t in enumerate(tokens) if len(t) > 3 and fields["tokenizer.ggml.token_type"][i] == 1)
    tokens[plain] = "</s>"
    tok = Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.tokens": tokens,
                                      "tokenizer.ggml.merges": []})
    assert tok.eos_ids == {tokens.index("<|im_end|>"), end}
    assert tok.eos_token == "<|im_end|>"  # the recorded EOS stays the template's

    fim = fim_tokenizer_of(tiny_config)
    ids = {t: fim.token_id(t) for t in ("<|repo_name|>", "<|file_sep|>", "<|fim_middle|>")}
    assert {ids["<|repo_name|>"], ids["<|file_sep|>"]} <= fim.eos_ids
    assert ids["<|fim_middle|>"] not in fim.eos_ids


def test_a_hugging_face_folder_stops_at_its_fim_separators(tiny_config, tmp_path):
    """generation_config.json lists a folder's EOS ids; its FIM separators (a new file
    beginning) end generation too."""
    from tests.conftest import fim_tokenizer_of

    fim = fim_tokenizer_of(tiny_config)
    fim.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["eos_token_ids"]  # (cadence's own key: what a downloaded folder lacks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    folder = Tokenizer.from_hf_dir(tmp_path)
    separators = {fim.token_id("<|repo_name|>"), fim.token_id("<|file_sep|>")}
    assert folder.eos_ids == {fim.token_id("<|im_end|>")} | separators
    assert folder.eos_token == "<|im_end|>"


def test_a_chat_template_is_named_a_file_or_its_own_text(tmp_path):
    text = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    assert chat.template_of(str(tmp_path / "t.jinja")) == text
    assert chat.template_of(text) == text
    assert chat.template_of("chatml") == chat.CHATML_TEMPLATE
    with pytest.raises(TokenizerError, match="not a file, a Jinja template, or one of the templates chatml"):
        chat.template_of(str(tmp_path / "missing.jinja"))
    with pytest.raises(TokenizerError, match=r"does not parse \(line 1"):
        chat.template_of("{% for %}")


def test_server_variables_are_beneath_a_requests_own(hf_bpe):
    assert chat.variables_of('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, why in (("[1]", "JSON object"), ("{", "not JSON"), ('{"messages": 1}', "'messages'")):
        with pytest.raises(TokenizerError, match=why):
            chat.variables_of(bad)
    tok = Tokenizer.from_gguf_fields({**gguf_fields(hf_bpe, "smollm"),
                                      "tokenizer.chat_template": "{{ a }}{{ b }}"})
    tok.chat_variables = {"a": "server-a", "b": "server-b"}
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "server-aserver-b"
    assert tok.apply_chat_template(messages, variables={"b": "own-b"}) == "server-aown-b"
