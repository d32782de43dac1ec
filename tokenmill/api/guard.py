"""The request envelope, checked before any route reads it: a JSON content type and a bounded body size.

A declared `Content-Length` over the limit is refused without reading a byte; a chunked body is counted as it arrives
and refused as soon as it passes the limit, so memory stays bounded whatever the client sends.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api import errors
from tokenmill.api.errors import APIError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        error = self._check_headers(Headers(scope=scope))
        if error is not None:
            await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _check_headers(self, headers: Headers) -> APIError | None:
        content_type = headers.get("content-type")
        if content_type is not None and not is_json(content_type):
            return errors.unsupported_media_type(content_type)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large(int(length))
        return None

    def _too_large(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else "more"
        return errors.invalid_request(
            f"The request body is too large: {got}; this server accepts at most {self.max_body_bytes} bytes.",
            code="request_too_large",
        )

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large(None)  # the app's APIError handler answers it
            return message

        return counted


def is_json(content_type: str) -> bool:
    """application/json (any parameters) or a structured `+json` type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
