"""Logprobs' token strings over HTTP on the real engine, with two tiny tokenizers: one byte a token, and a Gemma-shaped
vocabulary whose byte-fallback pieces cover what its few words do not. For any text, echoed or not, streamed or not,
with a stop string or without: "".join(tokens) is the returned text and text_offset[i] is where tokens[i] begins."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.api.api_helpers import TINY_MODEL, parse_sse, tiny_engine
from tests.api.gemma_vocab import gemma_vocab_engine
from tokenmill.api.app import create_app
from tokenmill.api.logprobs import empty_logprobs
from tokenmill.config import Config

HARD = [
    "x\uffffy",  # a noncharacter: three byte tokens, the last one finishes it
    "\U00020000\U0002a6a5",  # rare CJK: four byte tokens each
    "\U0001f469\u200d\U0001f4bb",  # an emoji sequence joined by ZWJ
    "e\u0301\u0323",  # combining marks
    "\ufffd",  # a real replacement character
    "\u2581",  # SentencePiece's space mark, which the tokenizer reads as a space
    "<eos>",
    " the capital of France",
    "\n\t",
]
characters = st.characters(codec="utf-8")  # every code point but the surrogates
texts = st.lists(st.one_of(st.text(characters, max_size=4), st.sampled_from(HARD)), max_size=5).map("".join)


@pytest.fixture(scope="module", params=["bytes", "gemma_vocab"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    engine = tiny_engine() if request.param == "bytes" else gemma_vocab_engine()
    with TestClient(create_app(engine, Config())) as test_client:
        yield test_client


def assert_tokens_cover_the_text(logprobs: dict[str, list[Any]], text: str, start: int) -> None:
    """`text`: what the tokens cover (the choice's text; without echo it follows `start` characters of prompt)."""
    tokens = logprobs["tokens"]
    assert "".join(tokens) == text
    assert logprobs["text_offset"] == [start + len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(tokens)


def streamed(client: TestClient, body: dict[str, Any]) -> tuple[str, dict[str, list[Any]]]:
    events = parse_sse(client.post("/v1/completions", json={**body, "stream": True}).text)
    text, logprobs = "", empty_logprobs()
    for event in events[:-1]:
        for choice in event["choices"]:
            text += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                logprobs[key] += values
    return text, logprobs


@settings(max_examples=25, deadline=None)
@given(
    prompt=texts,
    echo=st.booleans(),
    k=st.integers(0, 5),
    max_tokens=st.integers(0, 4),
    stop=st.none() | st.text(characters, min_size=1, max_size=2),
)
@example(prompt="x\uffffy", echo=True, k=1, max_tokens=0, stop=None)
@example(prompt="x\uffffy", echo=True, k=1, max_tokens=3, stop=None)
@example(prompt="\U00020000\U0002a6a5", echo=True, k=5, max_tokens=4, stop=None)
@example(prompt="a\U0001f469\u200d\U0001f4bbb", echo=False, k=2, max_tokens=4, stop=None)
def test_tokens_join_to_the_returned_text_and_offsets_point_into_it(
    client: TestClient, prompt: str, echo: bool, k: int, max_tokens: int, stop: str | None
) -> None:
    body = {"model": TINY_MODEL, "prompt": prompt, "echo": echo, "logprobs": k, "max_tokens": max_tokens}
    body |= {"temperature": 1.0, "seed": 7, "stop": stop}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    start = 0 if echo else len(prompt)
    if echo:
        assert choice["text"].startswith(prompt)
    assert_tokens_cover_the_text(choice["logprobs"], choice["text"], start)
    text, logprobs = streamed(client, body)
    assert (text, logprobs) == (choice["text"], choice["logprobs"])  # a stream joins to the same strings


def test_a_partial_byte_alternative_reads_as_the_text_it_would_complete(client: TestClient) -> None:
    """Within a prompt of four-byte characters the likely next tokens are bytes. Each alternative reads as the text it
    would add there: "" while the character would still be unfinished, never a lone U+FFFD."""
    body = {"model": TINY_MODEL, "prompt": "\U00020000" * 3, "echo": True, "logprobs": 5, "max_tokens": 0}
    top_logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    keys = [key for top in top_logprobs[1:] for key in top]
    assert "" in keys and not any(key.endswith("\ufffd") for key in keys)
