"""Byte-level BPE vocabularies (Llama 3, Qwen 2/2.5/3, StarCoder2, GPT-2) rebuilt from a GGUF file encode and decode
exactly like the model's own tokenizer.json (tests/tokenizer/bpe_families.py makes both)."""

from __future__ import annotations

import pytest

from tests.tokenizer.bpe_families import CODE, FAMILIES, gguf_metadata, own_tokenizer
from tests.tokenizer.reference import TEXTS, assert_same_as_transformers
from tokenmill.tokenizer import Tokenizer


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_gguf_built_tokenizer_equals_the_models_own(name: str) -> None:
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[name]
    own = own_tokenizer(family)
    ours = Tokenizer.from_gguf(gguf_metadata(family, own))
    theirs = PreTrainedTokenizerFast(tokenizer_object=own)
    texts = [*TEXTS, *CODE, "Cafe\u0301 (a decomposed é) and ﬁ ligature", "2024-12-01 12345678901"]
    assert_same_as_transformers(ours, theirs, texts)
    assert ours.vocab_size == own.get_vocab_size(with_added_tokens=True)
