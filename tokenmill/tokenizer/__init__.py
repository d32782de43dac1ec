"""Text ⇄ token ids: a Hugging Face `tokenizers` pipeline from a model directory or rebuilt from a GGUF vocabulary."""

from tokenmill.tokenizer.special import SpecialTokens
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = ["SpecialTokens", "Tokenizer"]
