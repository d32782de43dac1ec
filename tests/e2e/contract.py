"""The OpenAPI contract on every response of the e2e tier: wrappers for the network transports of httpx and httpx2.

Each response body read through a wrapped transport is fed to tests/openapi_contract.py's ResponseCheck as it streams;
a violation raises where it happens and is also kept in VIOLATIONS, so that a test whose client swallowed the error
still fails at teardown (conftest.py's check_contract).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.openapi_contract import ContractViolation, ResponseCheck

VIOLATIONS: list[str] = []  # appended from any thread; drained by check_contract after each test
CHECKED = {"bodies": 0}  # bodies read to the end and checked: proof that the wrapping is in place


def _finish(check: ResponseCheck, read_to_end: bool) -> None:
    problems = check.finish(read_to_end)
    CHECKED["bodies"] += check.checked
    _report(problems)


def _report(problems: list[str]) -> None:
    if problems:
        VIOLATIONS.extend(problems)
        raise ContractViolation("\n".join(problems))


def _checked_sync(lib: ModuleType, stream: Any, check: ResponseCheck) -> Any:
    class Checked(lib.SyncByteStream):  # type: ignore[name-defined]
        def __init__(self) -> None:
            self.read_to_end = False

        def __iter__(self) -> Iterator[bytes]:
            for chunk in stream:
                _report(check.feed(chunk))
                yield chunk
            self.read_to_end = True

        def close(self) -> None:
            stream.close()
            _finish(check, self.read_to_end)

    return Checked()


def _checked_async(lib: ModuleType, stream: Any, check: ResponseCheck) -> Any:
    class Checked(lib.AsyncByteStream):  # type: ignore[name-defined]
        def __init__(self) -> None:
            self.read_to_end = False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in stream:
                _report(check.feed(chunk))
                yield chunk
            self.read_to_end = True

        async def aclose(self) -> None:
            await stream.aclose()
            _finish(check, self.read_to_end)

    return Checked()


def _response_check(request: Any, response: Any) -> ResponseCheck:
    content_type = response.headers.get("content-type", "")
    return ResponseCheck(request.method, request.url.path, response.status_code, content_type)


def patch_transports(monkeypatch: pytest.MonkeyPatch, lib: ModuleType) -> None:
    sync_send, async_send = lib.HTTPTransport.handle_request, lib.AsyncHTTPTransport.handle_async_request

    def handle_request(self: Any, request: Any) -> Any:
        response = sync_send(self, request)
        check = _response_check(request, response)
        if check.active:
            response.stream = _checked_sync(lib, response.stream, check)
        return response

    async def handle_async_request(self: Any, request: Any) -> Any:
        response = await async_send(self, request)
        check = _response_check(request, response)
        if check.active:
            response.stream = _checked_async(lib, response.stream, check)
        return response

    monkeypatch.setattr(lib.HTTPTransport, "handle_request", handle_request)
    monkeypatch.setattr(lib.AsyncHTTPTransport, "handle_async_request", handle_async_request)
