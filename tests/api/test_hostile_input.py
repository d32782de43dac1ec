"""Hostile input against the real engine on the tiny model: each gets a clear 4xx quickly, and serving goes on.

Every request here runs under the suite's time bound; the payloads are sized so that a quadratic or unbounded path
would blow it (300k logit_bias entries, a 100k-character stop string, 100k levels of nesting).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, assert_openai_error, tiny_engine
from tokenmill.api.app import create_app
from tokenmill.config import Config

SECRET = "sk-very-secret-key"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_engine(), Config()), raise_server_exceptions=False) as test_client:
        yield test_client


def raw(**fields: Any) -> bytes:
    return json.dumps({"model": TINY_MODEL, "prompt": "hi", "max_tokens": 2, **fields}).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE: list[tuple[str, bytes, str | None, str]] = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', None, "not valid JSON (EOF"),
    ("not an object", b"[1, 2, 3]", None, "must be a JSON object"),
    ("deeply nested", nested(100_000), None, "recursion limit"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', None, "invalid unicode"),
    ("lone surrogate", b'{"model": "tiny", "prompt": "\\ud800"}', None, "not valid JSON"),
    ("5000-digit integer", b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None, "number"),
    ("1e400", b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', "temperature", "finite"),
    ("huge max_tokens", raw(max_tokens=10**20), "max_tokens", "less than or equal"),
    ("huge seed", raw(seed=-(10**30)), "seed", "greater than or equal"),
    ("huge n", raw(n=10**9), "n", "less than or equal"),
    ("huge token id", raw(prompt=[10**15]), "prompt", "outside the vocabulary"),
    ("logit_bias 300k entries", raw(logit_bias={str(i): 1 for i in range(300_000)}), "logit_bias", "at most 1024"),
    ("logit_bias 5000-digit key", raw(logit_bias={"9" * 5000: 1}), "logit_bias", "token ids"),
    ("logit_bias non-ASCII digit", raw(logit_bias={"²": 1}), "logit_bias", "token ids"),
    ("stop of 100k characters", raw(stop="x" * 100_000), "stop", "at most 1024 characters"),
    ("100k stop strings", raw(stop=["x"] * 100_000), "stop", "1 to 4"),
    ("prompt of 100k nested lists", raw(prompt=[[1]] * 100_000), "prompt", "Too many prompts"),
]


@pytest.mark.parametrize(("case", "payload", "param", "words"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_body_is_a_clear_400(
    client: TestClient, case: str, payload: bytes, param: str | None, words: str
) -> None:
    response = client.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("prompt", ["".join(map(chr, range(32))) * 3, "\x00" * 50, "\u202e\ufeff\u200b", "\x7f\x1b[2J"])
def test_prompts_of_control_characters_are_served(client: TestClient, prompt: str) -> None:
    response = client.post(
        "/v1/completions", json={"model": TINY_MODEL, "prompt": prompt, "max_tokens": 3, "echo": True}
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"].startswith(prompt)


def test_the_tokenizer_routes_refuse_hostile_bodies_too(client: TestClient) -> None:
    for path in ("/tokenize", "/detokenize"):
        response = client.post(path, content=nested(100_000), headers={"content-type": "application/json"})
        assert_openai_error(response, 400)
        assert_openai_error(client.post(path, content=b"prompt=hi", headers={"content-type": "text/plain"}), 415)


def test_api_keys_are_compared_in_constant_time_and_never_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real_compare = hmac.compare_digest

    def recording_compare(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr("tokenmill.api.app.hmac.compare_digest", recording_compare)
    caplog.set_level(logging.DEBUG)
    config = Config(api_key=(SECRET, "another-key"), log_level="debug")
    with TestClient(create_app(tiny_engine(), config), raise_server_exceptions=False) as secured:
        wrong = secured.post(
            "/v1/completions", json={"model": TINY_MODEL}, headers={"Authorization": f"Bearer {SECRET}x"}
        )
        right = secured.post(
            "/v1/completions",
            json={"model": TINY_MODEL, "prompt": "hi", "max_tokens": 1},
            headers={"Authorization": f"Bearer {SECRET}"},
        )
    error = assert_openai_error(wrong, 401, "invalid_api_key")
    assert error["type"] == "invalid_request_error" and SECRET not in wrong.text
    assert right.status_code == 200
    assert len(compared) == 4  # every configured key, for each request, whether or not an earlier one matched
    assert SECRET not in caplog.text
