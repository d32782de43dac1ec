"""Structured outputs: a grammar a sequence's text must follow (JSON Schema, regex, a list of choices, Lark or GBNF),
enforced token by token with llguidance, the grammar engine behind vLLM's and llama.cpp's guidance backends.

Each constrained sequence holds an llguidance matcher. Before each of its steps the matcher names the tokens that keep
the text inside the grammar (EOS only where the grammar is complete); the sampler masks every other token to -inf;
the chosen token is fed back. A sequence whose grammar admits nothing more ends with finish_reason "stop".

llguidance needs each token's bytes and a way to tokenise: built once per tokenizer, on the first constrained request,
and kept. It is handed them as a TokenizerWrapper (token_bytes below) rather than as the tokenizer.json it would parse
itself: parsing holds the interpreter, and so every request, for seconds on a 262k vocabulary, where the bytes are
worked out in Python, which lets other threads run, and the rest holds it for a fraction of that.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark

GuideKind = Literal["json", "regex", "grammar"]
# JSON in its compact form: no whitespace between tokens, so a model cannot pad a value forever
JSON_DEFAULTS: Any = {"whitespace_flexible": False}
# the largest constraint taken, as llguidance reads it (a schema's JSON, a regex): llguidance builds and checks a
# grammar holding the interpreter, in time and memory that grow with it, so a larger one is refused before it starts
MAX_GUIDE_CHARS = 1 << 18
BETWEEN_HOLDS_S = 0.05
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
            wrapped = TokenizerWrapper(_Vocabulary(tokenizer))
            # the mask's slices apart: two shorter holds of the interpreter than one, with a pause between them in
            # which the event loop can finish what the first held up (a /health, say) before the second starts
            ll = LLTokenizer(wrapped, n_vocab=tokenizer.vocab_size, eos_token=eos, slices=[])
            time.sleep(BETWEEN_HOLDS_S)
            ll = ll.with_slices(LLTokenizer.general_slices())
            cached = _tokenizers[key] = (tokenizer, ll)
        return cached[1]


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every token's bytes, the special ones, and encode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokens, self.special_token_ids = token_bytes(tokenizer.backend, tokenizer.vocab_size)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._backend = tokenizer.backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper asks once whether bytes are taken: they are not
            raise TypeError("text, not bytes")
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's ▁


def token_bytes(backend: Any, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """Each token's bytes as llguidance reads them from a tokenizer.json, and the special tokens' ids. A byte-level
    vocabulary (GPT-2's, Llama 3's, Qwen's) spells bytes as printable characters; a SentencePiece one spells a space
    as ▁ and a byte as <0xNN>; an added token is its own text."""
    added = {token.content: token.special for token in backend.get_added_tokens_decoder().values()}
    byte_level = "ByteLevel" in repr(backend.decoder)
    unbyte = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokens: list[bytes] = []
    specials: list[int] = []
    for token_id in range(vocab_size):
        text = backend.id_to_token(token_id)
        if text is None:
            tokens.append(b"")
        elif text in added:
            if added[text]:
                specials.append(token_id)
            tokens.append(text.replace(_SPACE, " ").encode())
        elif byte_level:
            tokens.append(bytes(unbyte[char] for char in text))
        elif match := _BYTE_TOKEN.fullmatch(text):
            tokens.append(bytes([int(match.group(1), 16)]))
        else:
            tokens.append(text.replace(_SPACE, " ").encode())
    return tokens, specials


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 as itself, the others from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = dict.fromkeys(range(256), ""), 0
    for byte in range(256):
        if byte in keep:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


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

    def forced(self, k: int) -> list[int]:
        """Up to k tokens that spell what the grammar allows alone from here (llguidance's fast-forward tokens: a
        JSON key the schema requires, say): a draft. The model may still spell the same text otherwise, so a draft
        it is, checked like any other."""
        return list(self.matcher.compute_ff_tokens()[:k]) if k > 0 else []

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from here, the grammar allows: past those a draft cannot be kept."""
        return int(self.matcher.validate_tokens(tokens)) if tokens else 0

    @property
    def done(self) -> bool:
        """The grammar admits nothing more."""
        return bool(self.matcher.is_stopped())
