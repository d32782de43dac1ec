"""llguidance's view of a tokenizer, built from the token bytes tokenmill works out (engine/guided.py), equals the one
llguidance builds itself from the tokenizer.json: every token's bytes, and the tokens its encoder gives."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from tests.engine.guided_views import assert_same_view
from tests.tiny_model import tiny_tokenizer
from tests.tokenizer.bpe_families import FAMILIES, gguf_metadata, own_tokenizer
from tokenmill.engine import guided
from tokenmill.tokenizer import Tokenizer


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
