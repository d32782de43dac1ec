"""Logprobs' token strings on the real Gemma 3 tokenizer (262k pieces, byte fallback) through the real server: for
texts it can only spell byte by byte, "".join(tokens) is the returned text and text_offset[i] is where tokens[i]
begins, echoed or not, streamed or not."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.api_helpers import parse_sse
from tests.e2e.server import MODEL, Server

HARD = [
    "x\uffffy",  # a noncharacter: byte-fallback pieces only
    "\U00020000\U0002a6a5 are rare CJK characters",
    "\U0001f469\u200d\U0001f4bb and \U0001f468\u200d\U0001f469\u200d\U0001f467 are emoji joined by ZWJ",
    "Cafe\u0301 n\u0303 a\u0323\u0302 combining marks",
    "\u2581 is read as a space by SentencePiece",
]


def complete(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    return choice


def streamed(server: Server, body: dict[str, Any]) -> tuple[str, list[str]]:
    response = httpx.post(
        server.base_url + "/v1/completions", json={"model": MODEL, **body, "stream": True}, timeout=120
    )
    text, tokens = "", []
    for event in parse_sse(response.text)[:-1]:
        for choice in event["choices"]:
            text += choice["text"]
            tokens += (choice["logprobs"] or {}).get("tokens", [])
    return text, tokens


def assert_tokens_cover_the_text(logprobs: dict[str, list[Any]], text: str, start: int) -> None:
    tokens = logprobs["tokens"]
    assert "".join(tokens) == text
    assert logprobs["text_offset"] == [start + len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("prompt", HARD)
@pytest.mark.parametrize("echo", [True, False])
def test_tokens_join_to_the_returned_text(server: Server, prompt: str, echo: bool) -> None:
    body = {"prompt": prompt, "echo": echo, "logprobs": 5, "max_tokens": 6, "temperature": 0}
    choice = complete(server, body)
    assert_tokens_cover_the_text(choice["logprobs"], choice["text"], 0 if echo else len(prompt))
    assert streamed(server, body) == (choice["text"], choice["logprobs"]["tokens"])


def test_scoring_a_byte_fallback_prompt_gives_each_character_to_the_token_that_finishes_it(server: Server) -> None:
    choice = complete(server, {"prompt": "x\uffffy", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert choice["logprobs"]["tokens"] == ["", "x", "", "", "\uffff", "y"]  # <bos>, x, <0xEF>, <0xBF>, <0xBF>, y
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 1, 1, 2]
