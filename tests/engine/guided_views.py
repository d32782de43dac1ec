"""llguidance's view of a tokenizer as tokenmill builds it, against the one llguidance builds from the tokenizer.json."""

from __future__ import annotations

from llguidance import LLTokenizer

from tokenmill.engine import guided
from tokenmill.tokenizer import Tokenizer

TEXTS = ["def f(x):\n    return  x + 1", "héllo wörld ✓ 日本", '{"a": [1, 2.5, null]}', "  \t\n  spaced"]


def assert_same_view(tokenizer: Tokenizer) -> None:
    eos = list(tokenizer.eos_ids)
    theirs = LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    ours = guided.ll_tokenizer(tokenizer)
    assert ours.vocab_size == theirs.vocab_size
    different = [i for i in range(tokenizer.vocab_size) if ours.decode_bytes([i]) != theirs.decode_bytes([i])]
    assert different == [], [(i, ours.decode_bytes([i]), theirs.decode_bytes([i])) for i in different[:5]]
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert ours.is_special_token(eos[0]) == theirs.is_special_token(eos[0])
