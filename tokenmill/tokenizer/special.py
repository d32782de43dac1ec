"""The special-token settings a bare tokenizer.json does not carry, and how a Hugging Face directory states them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class SpecialTokens:
    """The special-token settings a bare tokenizer.json does not carry."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    extra_eos_tokens: tuple[str, ...] = field(default=())  # other tokens that end generation (e.g. <end_of_turn>)


# --- Hugging Face directories ---------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """A special token as configs spell it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def special_from_dir(path: Path, backend: HFTokenizer) -> SpecialTokens:
    config = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")

    def token(name: str) -> str | None:
        return _token_text(config.get(name)) or _token_text(special_map.get(name))

    bos, eos = token("bos_token"), token("eos_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # no explicit flag: trust tokenizer.json's own post-processor
        add_bos = bos is not None and _post_processor_adds(backend, bos)
    return SpecialTokens(
        bos_token=bos,
        eos_token=eos,
        pad_token=token("pad_token"),
        add_bos=bool(add_bos),
        add_eos=bool(config.get("add_eos_token", False)),
        extra_eos_tokens=_generation_eos_tokens(path, backend),
    )


def _post_processor_adds(backend: HFTokenizer, token: str) -> bool:
    token_id = backend.token_to_id(token)
    ids = backend.encode("a", add_special_tokens=True).ids
    return token_id is not None and bool(ids) and ids[0] == token_id


def _generation_eos_tokens(path: Path, backend: HFTokenizer) -> tuple[str, ...]:
    ids = _read_json(path / "generation_config.json").get("eos_token_id")
    if ids is None:
        ids = _read_json(path / "config.json").get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    tokens = (backend.id_to_token(i) for i in ids)
    return tuple(t for t in tokens if t is not None)
