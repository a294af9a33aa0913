"""The texts the tokenizer checks send to llama.cpp and to cadence (`parity.py`,
`../gemma3-cpu/tokenizer.py`): scripts, numbers, code, whitespace and symbol runs."""

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'M SURE IT'S FINE, ISN'T IT? We'll see; they've said so, you'd think. O'Neil's car.",
    "getElementById XMLHttpRequest parseJSONResponse camelCaseWords snake_case_words CONSTANT_NAME",
    "Numbers: 1234567, 3.14159, 2024-06-01, 1e-9, 0xDEADBEEF, 1,000,000 and ٣٤٥ and ５６７.",
    "def main():\n    for i in range(10):\n\t\tprint(f\"{i:>4}\")\r\n    return None  \n\n\n",
    "path/to/file.py // comment /* block */ https://example.com/a?b=c&d=e#f ../../up\n",
    '{"key": [1, 2, {"nested": true}], "s": "quote \\" inside"}\n',
    "Café, naïve, façade, jalapeño, Zürich, ÉCOLE, Éa, ÀÉÎÕÜ and İstanbul; ǅemal and ǈ.",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。カタカナとひらがな。",
    "Ελληνικά γράμματα και русский текст, а также العربية و עברית and हिन्दी भाषा.",
    "Emoji 🎉🚀😀👩‍👩‍👧‍👦 and symbols ™ © ° ± → ∑ ∞ ≈ ≠ ½ ² µ ß ﬁ.",
    "   leading spaces, trailing spaces   \n \n\t mixed whitespace\u00a0nbsp\u2003em\u3000ideographic",
    "!!!???... --- *** ### $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> ||| \\\\\\ ~~~ ```",
    "Mixed1Words2With3Digits and ABCdef and abcDEF and A1b2C3 and ALLCAPS123lower.",
]
