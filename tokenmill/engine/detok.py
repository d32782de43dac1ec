"""Incremental detokenisation: text deltas that never split a UTF-8 character.

Decoding a token alone is wrong for byte-fallback pieces and for tokenizers whose decoders look at neighbours, so each
step decodes a short window of recent tokens twice (with and without the new ones) and emits the difference. A delta
ending in U+FFFD means a character is still incomplete: it is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # tokens of left context kept so the decoder sees each new token's neighbours


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be "" while a character is unfinished)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, replacement characters included."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
