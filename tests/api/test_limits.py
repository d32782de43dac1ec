"""Per-request limits and the request envelope: body size, content type, prompts, sequences, prompt tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import body, run
from tests.api.fake_engine import FakeEngine
from tokenmill.api.app import create_app
from tokenmill.api.guard import is_json
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
