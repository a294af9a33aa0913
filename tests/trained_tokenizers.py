"""Tokenizers trained here, in seconds, for the tests: a byte-level BPE (SmolLM2's
pre-tokenizer and chat template) as a GGUF file's tokenizer.* keys, and a SentencePiece BPE with
byte fallback as an HF folder. No network, no files outside a test's temporary folder.

    Tokenizer.from_gguf_fields(gguf_fields(trained_bpe(), "smollm"))
    Tokenizer.from_hf_dir(train_spm(folder))
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "It's a truth universally acknowledged that we'll need more tokens; they've said so.",
    "Numbers like 12345, 3.14159 and 2024-06-01 appear in text and in code: x = 42 * y",
    "def main():\n    for i in range(10):\n        print(i)\n\treturn None\n",
    "Café, naïve, façade, jalapeño, Zürich, Ærøskøbing, São Paulo, Kraków and Ñandú.",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。",
    "Emoji: 🎉🚀😀 and symbols ™ © ° ± → ∑ ∞ ≈ ≠ appear sometimes.",
    "Ελληνικά γράμματα και русский текст, а также العربية و עברית.",
] * 20

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def trained_bpe() -> tokenizers.Tokenizer:
    hf = tokenizers.Tokenizer(models.BPE())
    # SmolLM2's own pre-tokenizer: every digit alone, then the GPT-2 regex over bytes.
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIALS) + 400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(CORPUS, trainer=trainer)
    return hf


def gguf_fields(hf: tokenizers.Tokenizer, pre: str) -> dict:
    vocab = hf.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(hf.to_str())["model"]["merges"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.eot_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": SMOLLM2_TEMPLATE,
    }


def train_spm(folder: Path) -> Path:
    """A SentencePiece BPE with byte fallback and a dummy prefix, trained into `folder` with
    its tokenizer_config.json (BOS added): an HF tokenizer folder."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS[:5] * 20), model_prefix=str(folder / "tokenizer"),
        model_type="bpe", vocab_size=400, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, control_symbols=["<|im_start|>", "<|im_end|>"],
        num_threads=1, minloglevel=2)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return folder
