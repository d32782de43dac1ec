"""The tokenizer tests' yardstick: texts that stress a tokenizer, and an exact comparison with `transformers`' one."""

from __future__ import annotations

from tokenmill.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)\n",
    "  leading spaces, trailing spaces   ",
    "many     runs\u00a0of      spaces\n\n\n\nand\r\nnewlines\t\t\ttabs",
    "Café déjà vu, naïve façade, Ångström, Straße, ñandú",
    "日本語のテキストと中文文本，한국어도 있습니다。",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷 and ZWJ",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text with literal <eos> and <pad> tokens <unused12>",
    "x" * 300,
    "",
    " ",
    "\n",
    "Ünïcödé ∑∫√∞ ≠ ≤ ≥ ‰ € £ ¥ © ® ™ — – … «» ‹› “” ‘’",
    'JSON: {"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
]


def assert_same_as_transformers(ours: Tokenizer, theirs: object, texts: list[str]) -> None:
    """Encoding (with and without special tokens) and decoding (skipping them or not) equal `theirs`, text by text."""
    for text in texts:
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special).input_ids  # type: ignore[operator]
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text  # type: ignore[attr-defined]
