"""Structured outputs: a grammar a sequence's text must follow (JSON Schema, regex, a list of choices, Lark or GBNF),
enforced token by token with llguidance, the grammar engine behind vLLM's and llama.cpp's guidance backends.

Each constrained sequence holds an llguidance matcher. Before each of its steps the matcher names the tokens that keep
the text inside the grammar (EOS only where the grammar is complete); the sampler masks every other token to -inf;
the chosen token is fed back. A sequence whose grammar admits nothing more ends with finish_reason "stop".

llguidance needs the tokenizer's own description (its tokenizer.json) to map tokens to bytes: built once per
tokenizer, on the first constrained request (about 2 s for a 262k vocabulary), and kept.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

GuideKind = Literal["json", "regex", "grammar"]
# JSON in its compact form: no whitespace between tokens, so a model cannot pad a value forever
JSON_DEFAULTS: Any = {"whitespace_flexible": False}
# the largest constraint taken, as llguidance reads it (a schema's JSON, a regex): llguidance builds and checks a
# grammar holding the interpreter, in time and memory that grow with it, so a larger one is refused before it starts
MAX_GUIDE_CHARS = 1 << 18
MAX_REASON_CHARS = 300  # llguidance's errors quote the whole grammar: a client gets the first line, this long


class GuideError(ValueError):
    """The constraint cannot be used: an invalid schema, regex or grammar, or one too large or complex for the
    matcher (the message says where, in a line)."""


def reason(text: str) -> str:
    """The first line of llguidance's error, cut short: what it quotes of the grammar can be the whole request."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_REASON_CHARS else line[:MAX_REASON_CHARS] + "…"


@dataclass(frozen=True)
class Guide:
    kind: GuideKind
    source: str  # the JSON Schema as JSON text, the regex, or the Lark / GBNF grammar

    def grammar(self) -> str:
        """llguidance's grammar description of this constraint; GuideError when it cannot be made."""
        try:
            if self.kind == "json":
                return str(LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_DEFAULTS))
            if self.kind == "regex":
                return str(LLMatcher.grammar_from_regex(self.source))
            return str(LLMatcher.grammar_from_lark(any_to_lark(self.source)))
        except Exception as exc:  # noqa: BLE001 - llguidance and its GBNF converter raise their own kinds
            prefix = "the grammar is neither valid Lark nor GBNF: " if self.kind == "grammar" else ""
            raise GuideError(f"{prefix}{reason(str(exc))}") from None


def json_schema_guide(schema: Any) -> Guide:
    return Guide("json", json.dumps(schema))


_tokenizers: dict[int, tuple[Any, LLTokenizer]] = {}
_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's view of `tokenizer` (a tokenmill Tokenizer: its `backend` is a `tokenizers` pipeline)."""
    key = id(tokenizer)
    with _lock:
        cached = _tokenizers.get(key)
        if cached is None or cached[0] is not tokenizer:
            backend = getattr(tokenizer, "backend", None)
            if backend is None:
                raise GuideError("this model's tokenizer cannot drive structured outputs (no tokenizer.json)")
            eos = list(tokenizer.eos_ids)
            ll = LLTokenizer(backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
            cached = _tokenizers[key] = (tokenizer, ll)
        return cached[1]


def check(guide: Guide, tokenizer: Any) -> None:
    """Raises GuideError with llguidance's reason when the constraint is unusable with this tokenizer, or too large
    to be worth trying (MAX_GUIDE_CHARS)."""
    if len(guide.source) > MAX_GUIDE_CHARS:
        raise GuideError(
            f"it is {len(guide.source)} characters as a grammar; this server takes at most {MAX_GUIDE_CHARS}"
        )
    error = LLMatcher.validate_grammar(guide.grammar(), ll_tokenizer(tokenizer))
    if error:
        raise GuideError(reason(error))


class GuidedState:
    """One sequence's place in its grammar."""

    def __init__(self, guide: Guide, tokenizer: Any, logits_width: int) -> None:
        """`logits_width`: the model's vocabulary, which may have rows past the tokenizer's (never allowed)."""
        self.matcher = LLMatcher(ll_tokenizer(tokenizer), guide.grammar())
        self.vocab, self.width = tokenizer.vocab_size, logits_width
        self._bits = torch.full(((self.vocab + 31) // 32,), -1, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """(logits_width,) bool: the tokens that keep the text inside the grammar."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * self._bits.element_size())
        mask = torch.zeros(self.width, dtype=torch.bool)
        mask[: self.vocab] = ((self._bits[:, None] >> self._shifts) & 1).flatten()[: self.vocab].bool()
        return mask

    def advance(self, token_id: int) -> None:
        """A grammar can pass validation and still outgrow the matcher's limits as the text grows (a row of thousands
        of alternatives): that is the constraint's fault, a GuideError, not the engine's."""
        if not self.matcher.consume_token(token_id):
            raise GuideError(f"the grammar failed at token {token_id}: {reason(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar admits nothing more."""
        return bool(self.matcher.is_stopped())
