"""Tokenizer: a Hugging Face `tokenizers.Tokenizer` plus the model's special-token settings.

Built from a Hugging Face model directory (tokenizer.json + configs) or from a GGUF file's vocabulary. The GGUF builders
reproduce the family's own tokenizer.json, so token ids match it; they match a `transformers` tokenizer loaded with
`gguf_file=` too, except on Gemma's long runs of spaces (docs/decisions/0026-gemma-whitespace-runs.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from tokenmill.tokenizer.fim import FimTokens, find_fim
from tokenmill.tokenizer.gguf import build_gguf_tokenizer
from tokenmill.tokenizer.special import SpecialTokens, special_from_dir

SETTINGS_FILE = "tokenmill_tokenizer.json"
# From this many characters (or ids), encode and decode go through tokenizers' batch calls, which let go of the GIL:
# its single calls hold it throughout, about 10 ms at this length. Shorter ones (every token's detokenising) stay
# single: the batch calls hand their work to tokenizers' own thread pool, whose threads then compete with torch's.
LONG = 1 << 14
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Text ⇄ token ids for one model."""

    def __init__(self, backend: HFTokenizer, special: SpecialTokens) -> None:
        self._tok = backend
        self.special = special
        self.bos_id = self._id_of(special.bos_token)
        self.eos_id = self._id_of(special.eos_token)
        self.pad_id = self._id_of(special.pad_token)
        self.fim: FimTokens | None = find_fim(backend.token_to_id)
        # asked on every request (the vocabulary checks) and ~0.6 ms a time for a 262k vocabulary: read once
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        _set_post_processor(backend, special, self.bos_id, self.eos_id)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # --- properties -------------------------------------------------------------------------------------------------
    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return self.special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.special.eos_token

    @property
    def pad_token(self) -> str | None:
        return self.special.pad_token

    @property
    def add_bos(self) -> bool:
        return self.special.add_bos and self.bos_id is not None

    @property
    def chat_template(self) -> str | None:
        """None: tokenmill completes text and keeps no chat template (/tokenizer_info still names the field)."""
        return None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos plus the model's extra end tokens."""
        tokens = (self.special.eos_token, *self.special.extra_eos_tokens)
        ids = (self._id_of(t) for t in tokens)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def supports_fim(self) -> bool:
        return self.fim is not None

    @property
    def fim_end_ids(self) -> tuple[int, ...]:
        """The tokens that end a filled-in middle (none without FIM tokens)."""
        return self.fim.ends if self.fim is not None else ()

    # --- encode / decode --------------------------------------------------------------------------------------------
    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt (prefix-suffix-middle, tokenizer/fim.py): the model then writes the middle."""
        if self.fim is None:
            raise ValueError("this tokenizer has no fill-in-the-middle tokens")
        start = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return [
            *start,
            self.fim.prefix,
            *self.encode(prefix, add_special_tokens=False),
            self.fim.suffix,
            *self.encode(suffix, add_special_tokens=False),
            self.fim.middle,
        ]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # the batch call lets go of the GIL while it works (a worker thread's long prompt leaves the event loop free)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if len(ids) < LONG:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]  # the GIL let go too

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # --- persistence ------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        (directory / SETTINGS_FILE).write_text(json.dumps(asdict(self.special), indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        settings = json.loads((directory / SETTINGS_FILE).read_text())
        settings["extra_eos_tokens"] = tuple(settings.get("extra_eos_tokens", ()))
        return cls(HFTokenizer.from_file(str(directory / TOKENIZER_FILE)), SpecialTokens(**settings))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata values (`tokenizer.ggml.*` and `general.architecture`) as plain Python values."""
        backend, special = build_gguf_tokenizer(metadata)
        return cls(backend, special)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory: tokenizer.json and its tokenizer/generation configs."""
        path = Path(path)
        if not (path / TOKENIZER_FILE).exists():
            raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}; only fast (tokenizers) tokenizers are supported")
        backend = HFTokenizer.from_file(str(path / TOKENIZER_FILE))
        return cls(backend, special_from_dir(path, backend))


def _set_post_processor(tok: HFTokenizer, special: SpecialTokens, bos_id: int | None, eos_id: int | None) -> None:
    """BOS/EOS around each encoded text as the settings say; `transformers` rebuilds its post-processor the same way."""
    bos = (special.bos_token, bos_id) if special.add_bos and special.bos_token and bos_id is not None else None
    eos = (special.eos_token, eos_id) if special.add_eos and special.eos_token and eos_id is not None else None
    if bos is None and eos is None:
        tok.post_processor = None
        return
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    tokens = [token for token in (bos, eos) if token is not None]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict(tokens).items())
    )
