"""OpenAI's legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset) from engine TokenLogprobs.

One `LogprobsBuilder` per choice: it remembers the character offset reached so far, so streamed fragments and the
non-streamed whole carry the same offsets. `-inf`/NaN never reach JSON: they become `MIN_LOGPROB`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from tokenmill.engine.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # what a -inf (or NaN) logprob is reported as; JSON has no infinity


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def empty_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def extend_logprobs(into: dict[str, list[Any]], fragment: dict[str, list[Any]]) -> None:
    for key, values in fragment.items():
        into[key].extend(values)


def top_logprobs(entry: TokenLogprob, k: int) -> dict[str, float] | None:
    """Up to k alternatives plus the chosen token (so up to k+1 keys); several ids may share a text: keep the best."""
    if entry.logprob is None:
        return None
    best: dict[str, float] = {}
    for _, text, logprob in [*entry.top[:k], (entry.token_id, entry.text, entry.logprob)]:
        value = finite(logprob)
        if text not in best or value > best[text]:
            best[text] = value
    return dict(sorted(best.items(), key=lambda item: -item[1]))


def vllm_prompt_logprobs(entries: Iterable[TokenLogprob], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null where it has no context, else a map token id → {logprob, rank,
    decoded_token} holding the prompt token itself and the k likeliest tokens."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        position = {str(entry.token_id): _vllm_entry(entry.logprob, entry.rank, entry.text)}
        for rank, (token_id, text, logprob) in enumerate(entry.top[:k], start=1):
            position.setdefault(str(token_id), _vllm_entry(logprob, rank, text))
        out.append(position)
    return out


def _vllm_entry(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": text}


class LogprobsBuilder:
    def __init__(self, top_k: int, start: int = 0) -> None:
        self.top_k = top_k
        self.offset = start  # characters of the choice's text (with the prompt's, without echo) already covered

    def prompt(self, entries: Iterable[TokenLogprob], prompt_text: str) -> dict[str, list[Any]]:
        """Echoed prompt tokens. Their texts and offsets follow the echoed text, so "".join(tokens) is the returned
        text and `text_offset` an index into it: a token whose text is not there (a BOS the tokenizer added to a
        string prompt, say) is reported as "" and takes no room."""
        fragment = empty_logprobs()
        for entry in entries:
            shown = entry.text and prompt_text.startswith(entry.text, self.offset)
            self._append(fragment, entry if shown else dataclasses.replace(entry, text=""))
            if shown:
                self.offset += len(entry.text)
        self.offset = len(prompt_text)
        return fragment

    def generated(self, entries: Iterable[TokenLogprob]) -> dict[str, list[Any]]:
        fragment = empty_logprobs()
        for entry in entries:
            self._append(fragment, entry)
            self.offset += len(entry.text)
        return fragment

    def _append(self, fragment: dict[str, list[Any]], entry: TokenLogprob) -> None:
        fragment["tokens"].append(entry.text)
        fragment["token_logprobs"].append(None if entry.logprob is None else finite(entry.logprob))
        fragment["top_logprobs"].append(top_logprobs(entry, self.top_k))
        fragment["text_offset"].append(self.offset)
