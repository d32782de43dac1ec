"""CORS: a browser's preflight is answered without the API key, for the origins the flags allow and no others; the
request that follows still needs the key, and its answer names the origin it may be read by."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import assert_openai_error, body
from tests.api.fake_engine import FakeEngine
from tokenmill.api.app import create_app
from tokenmill.config import Config

KEY = "sk-test"


def preflight(client: TestClient, origin: str, headers: str = "authorization, content-type") -> dict[str, str]:
    response = client.options(
        "/v1/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": headers,
        },
    )
    return {"status": str(response.status_code), **response.headers}


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080", "http://[::1]:3000"])
def test_by_default_pages_on_this_machine_may_call_the_api(origin: str) -> None:
    with TestClient(create_app(FakeEngine(), Config(api_key=(KEY,)))) as client:
        answer = preflight(client, origin)
        assert answer["status"] == "200"  # answered without the key
        assert answer["access-control-allow-origin"] == origin
        assert "POST" in answer["access-control-allow-methods"]
        assert "authorization" in answer["access-control-allow-headers"].lower()
        refused = client.post("/v1/completions", json=body(), headers={"Origin": origin})
        assert_openai_error(refused, 401)  # the request itself still needs the key
        assert refused.headers["access-control-allow-origin"] == origin  # and the page can read why
        served = client.post(
            "/v1/completions", json=body(), headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}
        )
        assert served.status_code == 200 and served.headers["access-control-allow-origin"] == origin
        assert "x-request-id" in served.headers["access-control-expose-headers"]


@pytest.mark.parametrize("origin", ["https://example.com", "http://localhost.example.com:80", "null"])
def test_by_default_other_origins_get_no_cors_headers(origin: str) -> None:
    with TestClient(create_app(FakeEngine(), Config())) as client:
        answer = preflight(client, origin)
        assert answer["status"] == "400" and "access-control-allow-origin" not in answer
        served = client.post("/v1/completions", json=body(), headers={"Origin": origin})
        assert served.status_code == 200 and "access-control-allow-origin" not in served.headers


def test_allowed_origins_flags() -> None:
    config = Config(
        allowed_origins=("https://app.example.com",),
        allowed_methods=("POST",),
        allowed_headers=("content-type",),
        allow_credentials=True,
    )
    with TestClient(create_app(FakeEngine(), config)) as client:
        answer = preflight(client, "https://app.example.com", headers="content-type")
        assert answer["status"] == "200" and answer["access-control-allow-origin"] == "https://app.example.com"
        assert answer["access-control-allow-credentials"] == "true"
        assert preflight(client, "https://app.example.com", headers="x-other")["status"] == "400"
        assert preflight(client, "http://localhost:5173")["status"] == "400"  # the flag replaces the default


def test_any_origin() -> None:
    with TestClient(create_app(FakeEngine(), Config(allowed_origins=("*",)))) as client:
        answer = preflight(client, "https://anywhere.example")
        assert answer["status"] == "200" and answer["access-control-allow-origin"] == "*"
