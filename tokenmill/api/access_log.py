"""The access log: one line per HTTP request, written when its response is over (a stream's when it ends), and the
HTTP metrics, counted at the same moment.

A pure ASGI middleware (not BaseHTTPMiddleware), so streams pass through unbuffered, and the outermost of ours, so it
also sees what the API-key check and the envelope guard refuse. The request id is the client's `x-request-id` when it
is sane (REQUEST_ID), otherwise a new one; every response carries it back, errors included. What a route learnt (its
completion's record, the APIError it answered with) reaches the line through the ASGI scope's state (`request.state`).
A line never holds a key, a prompt or an output: those come only in a record built with --log-prompts.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.api.logs import text_value
from tokenmill.api.metrics import Metrics
from tokenmill.api.record import CompletionRecord

log = logging.getLogger("tokenmill.access")

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:=+/-]{1,128}")  # a client's id is kept only if it is this: no spaces, bounded
UNMATCHED = "unmatched"  # the route label of a path no route serves (never the path itself: unbounded)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"
IN_MESSAGE = ("method", "path", "status")  # what the line's message says; the fields repeat them only in JSON

_ID, _ERROR, _COMPLETION = "request_id", "error", "completion"  # keys of the scope's state


# --- what routes and handlers tell the line ------------------------------------------------------------------------
def request_id(scope: Scope) -> str | None:
    value = scope.get("state", {}).get(_ID)
    return value if isinstance(value, str) else None


def note_error(scope: Scope, error: APIError) -> None:
    """Whoever answers with an APIError says so (the app's handler does for raised ones): the line names its code,
    and a 429 is counted by its reason."""
    scope.setdefault("state", {})[_ERROR] = error


def note_completion(scope: Scope, record: CompletionRecord) -> None:
    scope.setdefault("state", {})[_COMPLETION] = record


# --- the middleware ------------------------------------------------------------------------------------------------
class AccessLog:
    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # to name the route of a request refused before routing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        rid = _sane_id(Headers(scope=scope).get(REQUEST_ID_HEADER)) or uuid.uuid4().hex
        scope.setdefault("state", {})[_ID] = rid
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as exc:  # an error the outer handler answers with 500, or a cancellation
            if status is None:
                status = 500 if isinstance(exc, Exception) else CLIENT_CLOSED_REQUEST
            raise
        finally:
            self._write(scope, status or CLIENT_CLOSED_REQUEST, time.monotonic() - started)

    def _write(self, scope: Scope, status: int, duration_s: float) -> None:
        state = scope.get("state", {})
        error: APIError | None = state.get(_ERROR)
        record: CompletionRecord | None = state.get(_COMPLETION)
        route = route_of(scope, self.routes)
        failed = status >= 500 or (record is not None and (record.error_status or 0) >= 500)
        self.metrics.answered(route, status, failed, error.reason if error is not None else None)
        fields = line_fields(scope, route, status, duration_s, error, record)
        method, path = text_value(scope["method"]), text_value(scope["path"])  # quoted unless plain: one line always
        log.info("%s %s %d", method, path, status, extra={"fields": fields, "in_message": IN_MESSAGE})


def _sane_id(value: str | None) -> str | None:
    return value if value is not None and REQUEST_ID.fullmatch(value) else None


def route_of(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The template of the route that served the request (`/v1/models/{model_id:path}`), or of the one in `routes`
    that would have, for a request refused before routing (by the key check or the envelope guard)."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    for candidate in routes:
        template = getattr(candidate, "path", None)
        if isinstance(template, str) and candidate.matches(scope)[0] is not Match.NONE:
            return template
    return UNMATCHED


def line_fields(
    scope: Scope, route: str, status: int, duration_s: float, error: APIError | None, record: CompletionRecord | None
) -> dict[str, Any]:
    client = scope.get("client")
    fields: dict[str, Any] = {
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "duration_ms": _ms(duration_s),
        "request_id": request_id(scope),
        "route": route,
        "client": client[0] if client else None,
        "error": error.code or error.type if error is not None else None,
    }
    if record is not None:
        fields.update(_completion_fields(record))
    return fields


def _completion_fields(record: CompletionRecord) -> dict[str, Any]:
    return {
        "model": record.model,
        "completion_id": record.completion_id,
        "stream": record.stream,
        "prompts": len(record.prompts),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
        "ttft_ms": _ms(record.ttft_s),
        "finish_reasons": record.finish_reasons,
        "outcome": record.outcome,
        "stream_error": record.error_code if record.stream and record.error_status is not None else None,
        "user": record.user,
        "prompt": record.prompt,
        "output": record.outputs,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
