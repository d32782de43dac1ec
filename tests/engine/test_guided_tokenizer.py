"""llguidance's view of a tokenizer, built from the token bytes tokenmill works out (engine/guided.py), equals the one
llguidance builds itself from the tokenizer.json: every token's bytes, and the tokens its encoder gives."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher, LLTokenizer

from tests.tiny_model import tiny_tokenizer
from tests.tokenizer.test_bpe_families import FAMILIES, gguf_metadata, own_tokenizer
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


def test_a_sentencepiece_vocabulary_with_byte_fallback() -> None:
    assert_same_view(tiny_tokenizer())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_byte_level_vocabularies(name: str) -> None:
    family = FAMILIES[name]
    assert_same_view(Tokenizer.from_gguf(gguf_metadata(family, own_tokenizer(family))))


def test_a_grammar_runs_on_it() -> None:
    tokenizer = tiny_tokenizer()
    grammar = guided.Guide("regex", "(ab|cd)+").grammar()
    matcher = LLMatcher(guided.ll_tokenizer(tokenizer), grammar)
    assert not matcher.get_error()
    assert matcher.consume_tokens(tokenizer.encode("abcd", add_special_tokens=False))
