from __future__ import annotations

import pytest

from tokenmill.api import errors
from tokenmill.api.errors import APIError

HELPERS: list[tuple[APIError, int, str, str | None, str | None]] = [
    (errors.invalid_request("bad", "n"), 400, "invalid_request_error", "n", None),
    (errors.model_not_found("gpt-9"), 404, "invalid_request_error", "model", "model_not_found"),
    (errors.authentication("no key"), 401, "invalid_request_error", None, "invalid_api_key"),
    (
        errors.context_length_exceeded(100, 90, 20),
        400,
        "invalid_request_error",
        "max_tokens",
        "context_length_exceeded",
    ),
    (errors.context_length_exceeded(100, 101, 0), 400, "invalid_request_error", "prompt", "context_length_exceeded"),
    (errors.not_found("where?"), 404, "invalid_request_error", None, "not_found"),
    (errors.method_not_allowed("no", "POST"), 405, "invalid_request_error", None, "method_not_allowed"),
    (errors.server_error(), 500, "server_error", None, None),
    (errors.service_unavailable("down"), 503, "server_error", None, "service_unavailable"),
]


@pytest.mark.parametrize(("error", "status", "type_", "param", "code"), HELPERS)
def test_helpers_build_openai_error_bodies(
    error: APIError, status: int, type_: str, param: str | None, code: str | None
) -> None:
    assert error.status == status
    assert error.body() == {"error": {"message": error.message, "type": type_, "param": param, "code": code}}


def test_context_message_states_both_numbers() -> None:
    message = errors.context_length_exceeded(8192, 8000, 500).message
    assert "8192" in message and "8500" in message and "8000 in your prompt" in message and "500" in message
