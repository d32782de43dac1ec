"""llguidance's view of Gemma 3's 262k vocabulary, as tokenmill builds it, equals the one llguidance builds from the
tokenizer.json: every token's bytes (byte fallback, whitespace runs, special tokens) and the encoder's tokens."""

from __future__ import annotations

from typing import Any

from tests.engine.guided_views import assert_same_view


def test_gemma_vocabulary(default_weights: Any) -> None:
    assert_same_view(default_weights.tokenizer)
