"""Per-request limits and the request envelope: body size, content type, prompts, sequences, prompt tokens, a text's
length against the context, the tokenizer routes' caps, the response's size; and tokenising off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.responses import JSONResponse

from tests.api.api_helpers import body, get, post, run
from tests.api.fake_engine import CharTokenizer, FakeEngine
from tests.tiny_model import tiny_tokenizer
from tokenmill.api.app import create_app
from tokenmill.api.guard import is_json
from tokenmill.api.limits import TextBound
from tokenmill.config import Config

LIMITS = Config(
    max_request_bytes=2000, max_prompts_per_request=3, max_choices_per_request=6, max_prompt_tokens_per_request=40
)


@pytest.fixture
def limited(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, LIMITS), raise_server_exceptions=False) as client:
        yield client


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        (body(prompt=["a", "b", "c", "d"]), "prompt", "Too many prompts: 4"),
        (body(prompt=["a", "b"], n=4), "n", "2 prompt(s) × 4"),
        (body(prompt=["a", "b"], n=1, best_of=4), "n", "at most 6"),
        (body(prompt=["x" * 30, "y" * 30]), "prompt", "Too many prompt tokens: 62"),
    ],
)
def test_request_limits_are_400s_naming_the_param(
    limited: TestClient, engine: FakeEngine, payload: dict[str, Any], param: str, words: str
) -> None:
    error = error_of(limited.post("/v1/completions", json=payload))
    assert error["param"] == param and words in error["message"]
    assert engine.requests == []


def test_requests_at_the_limits_are_served(limited: TestClient) -> None:
    assert limited.post("/v1/completions", json=body(prompt=["a", "b", "c"], n=2, max_tokens=2)).status_code == 200
    assert limited.post("/v1/completions", json=body(prompt=["x" * 19, "y" * 19], max_tokens=2)).status_code == 200


def test_a_declared_body_over_the_limit_is_refused_unread(limited: TestClient) -> None:
    raw = json.dumps(body(prompt="x" * 3000)).encode()
    error = error_of(limited.post("/v1/completions", content=raw, headers={"content-type": "application/json"}))
    assert error["code"] == "request_too_large" and "2000 bytes" in error["message"]


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(engine: FakeEngine) -> None:
    app = create_app(engine, LIMITS)
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(1000):  # would be 1 MB; the server stops reading after ~2 kB
            sent += 1
            yield b"x" * 1000
        yield b'"}'

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})

    error = error_of(run(go))
    assert error["code"] == "request_too_large" and engine.requests == []
    assert sent < 1000  # it stopped reading early


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_415(client: TestClient, content_type: str) -> None:
    raw = json.dumps(body()).encode()
    error = error_of(client.post("/v1/completions", content=raw, headers={"content-type": content_type}), 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        ("text/json", False),
        ("text/plain", False),
    ],
)
def test_is_json(content_type: str, expected: bool) -> None:
    assert is_json(content_type) is expected


def test_a_body_without_content_type_is_read_as_json(client: TestClient) -> None:
    response = client.post("/v1/completions", content=json.dumps(body(max_tokens=2)).encode())
    assert response.status_code == 200


def test_limits_come_from_config_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tokenmill.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    monkeypatch.setenv("TOKENMILL_REQUEST_TIMEOUT_S", "2.5")
    config = config_from_args(parser.parse_args(["--max-waiting-requests", "7", "--shutdown-grace-s", "0.5"]))
    assert (config.max_waiting_requests, config.request_timeout_s, config.shutdown_grace_s) == (7, 2.5, 0.5)
    assert Config().max_waiting_requests == 1024 and Config().request_timeout_s == 0.0


# --- bounded before work: text against the context, tokenising stopped at the limits -------------------------------
class SpiedTokenizer(CharTokenizer):
    """Records the length of every text it encodes and of every id list it decodes."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)


def spied_client(config: Config) -> tuple[TestClient, SpiedTokenizer]:
    tokenizer = SpiedTokenizer()
    return TestClient(create_app(FakeEngine(tokenizer=tokenizer), config), raise_server_exceptions=False), tokenizer


def test_a_text_that_cannot_fit_the_context_is_refused_without_being_tokenised() -> None:
    """Each of the fake's tokens is at most 5 characters ("<bos>"): 5000 characters are at least 251 tokens, past the
    context of 128, however they are tokenised."""
    client, tokenizer = spied_client(Config())
    with client:
        for fields in ({"prompt": "x" * 5000}, {"prompt": "x" * 5000, "truncate_prompt_tokens": 8}):
            error = error_of(client.post("/v1/completions", json=body(**fields)))
            assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
            assert "5000 characters is at least 251 tokens" in error["message"]
        assert tokenizer.encoded == []
        assert client.get("/health").status_code == 200


def test_tokenising_stops_at_the_first_prompt_past_a_limit() -> None:
    client, tokenizer = spied_client(Config(max_prompt_tokens_per_request=40))
    with client:
        error = error_of(client.post("/v1/completions", json=body(prompt=["x" * 30] * 3)))
        assert error["param"] == "prompt" and "Too many prompt tokens: 62 or more" in error["message"]
        assert tokenizer.encoded == [30, 30]  # the third prompt was never tokenised
        tokenizer.encoded.clear()
        error = error_of(client.post("/v1/completions", json=body(prompt=["y" * 127, "z", "z"], max_tokens=1)))
        assert error["code"] == "context_length_exceeded" and "128 in your prompt" in error["message"]
        assert tokenizer.encoded == [127]


def test_truncated_prompts_count_what_is_kept() -> None:
    client, _ = spied_client(Config(max_prompt_tokens_per_request=40))
    with client:
        payload = body(prompt=["x" * 100, "y" * 100], truncate_prompt_tokens=20, max_tokens=2)
        assert client.post("/v1/completions", json=payload).status_code == 200


@pytest.mark.parametrize(
    ("path", "payload", "param", "words"),
    [
        ("/tokenize", {"prompt": "x" * 100}, "prompt", "Too many tokens: 101"),
        ("/tokenize", {"prompt": list(range(3, 44))}, "prompt", "Too many tokens: 41"),
        ("/tokenize", {"prompt": "x" * 5000}, "prompt", "at least 251 tokens"),
        ("/detokenize", {"tokens": list(range(3, 44))}, "tokens", "Too many tokens: 41"),
    ],
)
def test_the_tokenizer_routes_are_capped(path: str, payload: dict[str, Any], param: str, words: str) -> None:
    client, tokenizer = spied_client(Config(max_prompt_tokens_per_request=40))
    with client:
        error = error_of(client.post(path, json=payload))
        assert error["param"] == param and words in error["message"], error
        assert all(n <= 100 for n in tokenizer.encoded)  # the 5000 characters were never tokenised
        assert client.post("/tokenize", json={"prompt": "x" * 30}).json()["count"] == 31


def test_text_bound_is_never_above_the_tokens_a_text_becomes() -> None:
    tokenizer = tiny_tokenizer()
    bound = TextBound.of(tokenizer)
    texts = ["", " " * 1000, "\n" * 999, "\t \n" * 300, "the capital of France is Paris. " * 40, "ᾂé" * 50, "<bos>" * 9]
    for text in texts:
        assert bound.fewest_tokens(len(text)) <= len(tokenizer.encode(text)), repr(text[:20])


# --- off the event loop: /health is answered while a request is tokenised -------------------------------------------
GATE_WAIT_S = 5.0


class GatedTokenizer(CharTokenizer):
    """Encodes and decodes long inputs only once `release` is set, telling `entered` when one is waiting: on the
    event loop it would hold every other request until it gave up."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def _gate(self, size: int) -> None:
        if size >= 40:
            self.entered.set()
            if not self.release.wait(GATE_WAIT_S):
                raise AssertionError("/health was not answered while a request was being tokenised")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._gate(len(text))
        return super().encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self._gate(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/completions", body(prompt="x" * 50, max_tokens=2)),
        ("/tokenize", {"prompt": "x" * 50}),
        ("/detokenize", {"tokens": [10] * 50}),
    ],
)
def test_health_is_answered_while_a_request_is_tokenised(path: str, payload: dict[str, Any]) -> None:
    tokenizer = GatedTokenizer()
    app = create_app(FakeEngine(tokenizer=tokenizer), Config())

    async def go() -> tuple[int, int]:
        slow = asyncio.create_task(post(app, path, payload))
        await asyncio.to_thread(tokenizer.entered.wait, GATE_WAIT_S)
        health = await get(app, "/health")
        tokenizer.release.set()
        return health.status_code, (await slow).status_code

    assert run(go) == (200, 200)


# --- the response's size ------------------------------------------------------------------------------------------
# 100 characters (101 tokens with BOS) echoed with logprobs 5 and prompt_logprobs 20: about 190 kB a choice
HEAVY = body(prompt="x" * 100, echo=True, logprobs=5, prompt_logprobs=20, max_tokens=0)


@pytest.mark.parametrize(
    ("budget", "fields", "param"),
    [(500_000, {"n": 3}, "n"), (100_000, {}, "prompt_logprobs"), (20_000, {"prompt_logprobs": None}, "logprobs")],
)
def test_a_response_over_the_budget_is_refused_naming_what_makes_it_large(
    engine: FakeEngine, budget: int, fields: dict[str, Any], param: str
) -> None:
    with TestClient(create_app(engine, Config(max_response_bytes=budget)), raise_server_exceptions=False) as client:
        payload = {key: value for key, value in {**HEAVY, **fields}.items() if value is not None}
        error = error_of(client.post("/v1/completions", json=payload))
        assert (error["param"], error["code"]) == (param, "response_too_large") and "too large" in error["message"]
        assert engine.requests == []


def test_a_response_within_the_budget_is_served_and_is_no_larger_than_estimated(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, Config(max_response_bytes=500_000)), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={**HEAVY, "n": 2})
        assert response.status_code == 200 and len(response.content) < 500_000
        assert len(response.json()["choices"]) == 2 and response.json()["choices"][1]["prompt_logprobs"]


def test_a_response_written_off_the_event_loop_is_byte_for_byte_what_json_response_writes(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json=body(prompt=r"\"quoted\" \\ <bos>", echo=True, logprobs=2, n=2))
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        assert response.content == JSONResponse(response.json()).body
