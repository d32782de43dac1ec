"""Helpers the API tests share: request bodies, OpenAI error checks, the real engine on the tiny model, and time-bounded
async access to the app (every request and every stream read gives up after TIMEOUT seconds)."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import openai
from fastapi import FastAPI

from tests.engine.tiny import tiny_core
from tokenmill.engine.engine import AsyncEngine

TIMEOUT = 10.0
MODEL = "fake-model"  # what FakeEngine serves
TINY_MODEL = "tiny"  # what tiny_engine() serves
T = TypeVar("T")


def tiny_engine() -> AsyncEngine:
    """The real AsyncEngine on the tiny random-weight model (tests/engine/tiny.py), not yet started."""
    return AsyncEngine(tiny_core(), TINY_MODEL, "fp_tiny")


# openai ≥ 3 ships on httpx2, older releases on httpx: build the transport from whichever it uses.
_httpx = importlib.import_module(
    "httpx2" if "httpx2" in openai.OpenAI.__init__.__annotations__.get("http_client", "") else "httpx"
)


def with_client(app: FastAPI, use: Callable[[openai.AsyncOpenAI], Awaitable[T]], api_key: str = "unused") -> T:
    """`use` with the official async client talking to `app` in-process (no lifespan: start engines in `use`)."""

    async def go() -> T:
        http = _httpx.AsyncClient(transport=_httpx.ASGITransport(app=app), base_url="http://test")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http, max_retries=0) as c:
            return await use(c)

    return run(go)


def run(make: Callable[[], Awaitable[T]], timeout: float = TIMEOUT) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(make(), timeout)

    return asyncio.run(bounded())


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The response has `status` and OpenAI's error body (and `code`, if given); returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return error


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


async def post(app: FastAPI, path: str, payload: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=payload, headers=headers)


async def get(app: FastAPI, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path, headers=headers)


async def hold_then_probe(app: FastAPI, held: int, probe: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    """Send `held` requests a FakeEngine(hang_at_step=0) never answers, then one more; cancel the held ones."""
    tasks = [asyncio.create_task(post(app, "/v1/completions", body(prompt="hold"))) for _ in range(held)]
    while app.state.admission.waiting_requests < held:
        await asyncio.sleep(0.001)
    probe_response = await post(app, "/v1/completions", probe)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return probe_response, results


def parse_sse(raw: str) -> list[Any]:
    """Each `data:` frame as parsed JSON, or the string "[DONE]"; asserts the framing is exact."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = []
    for frame in raw[:-2].split("\n\n"):
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(app: FastAPI, payload: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    response = run(lambda: post(app, "/v1/completions", payload))
    return response, parse_sse(response.text)


def asgi_scope(path: str, method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("test", 1234),
        "server": ("test", 80),
    }


async def call_then_disconnect(
    app: FastAPI, payload: dict[str, Any], disconnect_when: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """Drive the ASGI app by hand; report `http.disconnect` once `disconnect_when(sent messages)` holds."""
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}
        while not disconnect_when(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(asgi_scope("/v1/completions"), receive, send)
    return sent


def missing_members(protocol: type, implementation: object) -> list[str]:
    """The members of `protocol` (its attributes, properties and methods) that `implementation` lacks."""
    members = {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)
    return sorted(name for name in members if not hasattr(implementation, name))
