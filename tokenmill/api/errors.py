"""One typed error for everything the HTTP edge refuses or fails at, rendered as OpenAI's error body.

Code that finds a problem raises `APIError` (usually through a helper below); the app's exception handler turns it into
`{"error": {"message", "type", "param", "code"}}` with the right status. The type never comes from parsing messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
REQUEST_TIMEOUT = "request_timeout"  # the code of a completion stopped at --request-timeout-s
ENGINE_LOST = "engine_lost"  # the reason of a 503 for a request whose engine replica died under it (it may be retried)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        self.reason = reason  # why, in one word, for the metrics and the access log (never sent)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def context_length_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int) -> APIError:
    """prompt + max_tokens over the context; names the prompt when it alone does not fit, else max_tokens."""
    param = "prompt" if prompt_tokens > max_model_len else "max_tokens"
    message = (
        f"This model's maximum context length is {max_model_len} tokens, however you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in your prompt; {max_tokens} for the completion). "
        "Please reduce your prompt; or completion length."
    )
    return APIError(400, message, INVALID_REQUEST, param, "context_length_exceeded")


def model_not_found(model: str) -> APIError:
    message = f"The model `{model}` does not exist or you do not have access to it."
    return APIError(404, message, INVALID_REQUEST, "model", "model_not_found")


def authentication(message: str) -> APIError:
    return APIError(401, message, INVALID_REQUEST, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> APIError:
    return APIError(404, message, INVALID_REQUEST, None, "not_found")


def method_not_allowed(message: str, allow: str | None = None) -> APIError:
    headers = {"Allow": allow} if allow else None
    return APIError(405, message, INVALID_REQUEST, None, "method_not_allowed", headers)


def server_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, SERVER_ERROR)


def service_unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, SERVER_ERROR, None, "service_unavailable", headers)


def engine_lost() -> APIError:
    """The engine replica serving the request died (cluster/): the client may send it again, as Retry-After says."""
    error = service_unavailable("The engine replica serving this request was lost; please retry.", 1)
    error.reason = ENGINE_LOST
    return error


def rate_limited(message: str, limit: str, retry_after_s: int | None, reason: str | None = None) -> APIError:
    """429 as the hosted API words it: type names the exhausted limit ("requests" or "tokens"). No retry_after_s:
    waiting cannot help (the request is larger than the limit itself). `reason` labels the refusal in the metrics
    (tokenmill_rate_limited_total) and the log; default: the limit's name."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(429, message, limit, None, "rate_limit_exceeded", headers, reason=reason or limit)


def unsupported_media_type(content_type: str) -> APIError:
    message = (
        f"Unsupported Content-Type {content_type!r}: send the request body as JSON (Content-Type: application/json)."
    )
    return APIError(415, message, INVALID_REQUEST, None, "unsupported_media_type")


def request_timeout(timeout_s: float) -> APIError:
    message = (
        f"The request did not finish within this server's limit of {timeout_s:g} s (--request-timeout-s); "
        "it was stopped and its resources freed."
    )
    return APIError(504, message, SERVER_ERROR, None, REQUEST_TIMEOUT)
