"""Fill-in-the-middle: which tokens a code model was trained with, and the prompt it expects for the reference's
`suffix` field.

Found by the vocabulary itself, as llama.cpp does when a GGUF does not name them: the three token styles code models
ship with (Qwen2.5-Coder and CodeGemma, StarCoder/StarCoder2, CodeLlama). The prompt is laid out prefix-suffix-middle
(PSM), each part encoded without special tokens: [BOS if the model adds one] PRE prefix SUF suffix MID. The model then
writes the middle, which ends at one of the style's end tokens (end of middle, file separator, padding, end of text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FimStyle:
    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...]  # tokens that end a middle, where the vocabulary has them


STYLES = (
    # Qwen2.5-Coder (<|file_sep|>, <|fim_pad|>) and CodeGemma (<|file_separator|>)
    FimStyle(
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ("<|fim_pad|>", "<|file_sep|>", "<|file_separator|>", "<|repo_name|>", "<|endoftext|>"),
    ),
    FimStyle("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>", "<|endoftext|>")),  # StarCoder
    FimStyle("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", ("\u2581<EOT>",)),  # CodeLlama (SentencePiece ▁ prefix)
)


@dataclass(frozen=True)
class FimTokens:
    """The ids of a model's fill-in-the-middle tokens."""

    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]
    style: FimStyle


def find_fim(token_to_id: Callable[[str], int | None]) -> FimTokens | None:
    """The first style whose three tokens are all in the vocabulary, or None (the model cannot fill in)."""
    for style in STYLES:
        ids = [token_to_id(t) for t in (style.prefix, style.suffix, style.middle)]
        if all(i is not None for i in ids):
            ends = tuple(i for i in (token_to_id(t) for t in style.ends) if i is not None)
            prefix, suffix, middle = (int(i) for i in ids if i is not None)
            return FimTokens(prefix, suffix, middle, ends, style)
    return None
