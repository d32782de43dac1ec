"""Incremental detokenisation: text deltas that never split a UTF-8 character.

Decoding a token alone is wrong for byte-fallback pieces and for tokenizers whose decoders look at neighbours, so each
step decodes a short window of recent tokens twice (with and without the new ones) and emits the difference. A delta
ending in U+FFFD means a character is still incomplete: it is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # tokens of left context kept so the decoder sees each new token's neighbours
_MAX_CHAR_BYTES = 4  # a UTF-8 character is at most 4 bytes, so at most 3 byte tokens precede a clean start


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = self._clean_start(max(len(self.ids) - _CONTEXT_TOKENS, 0))

    def _clean_start(self, offset: int) -> int:
        """Moves the window's start back off the middle of a character (at most one character's bytes).

        Byte-fallback decoders turn every byte of a sequence into U+FFFD when any of it is invalid UTF-8, so a window
        that starts on a continuation byte would garble everything decoded after it.
        """
        for start in range(offset, max(offset - _MAX_CHAR_BYTES, 0) - 1, -1):
            if not self._decode(self.ids[start : self.read_offset]).startswith(_REPLACEMENT):
                return start
        return offset

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
