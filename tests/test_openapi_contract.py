"""The schema oracle itself: it accepts OpenAI's shapes (with the hosted API's nulls) and catches what breaks them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.openapi_contract import ResponseCheck, completion_problems, error_problems


def completion(**choice: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": "length", **choice}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


ECHO_LOGPROBS = {
    "tokens": ["<bos>", "a"],
    "token_logprobs": [None, -1.5],
    "top_logprobs": [None, {"a": -1.5}],
    "text_offset": [0, 0],
}


def test_valid_completion_and_the_echo_nulls_pass() -> None:
    assert completion_problems(completion()) == []
    assert completion_problems(completion(logprobs=ECHO_LOGPROBS)) == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"object": "completion"}, "object"),
        ({"created": "now"}, "created"),
        ({"usage": {"completion_tokens": 1}}, "usage"),
        ({"usage": None}, "usage"),
        ({"choices": [{"text": "x", "index": 0, "logprobs": None}]}, "choices/0"),
        ({"choices": [{"text": "x", "index": 0, "logprobs": None, "finish_reason": "eos"}]}, "finish_reason"),
        (
            {"choices": [{"text": "x", "index": 0, "logprobs": {"token_logprobs": ["-1"]}, "finish_reason": None}]},
            "choices/0",
        ),
    ],
)
def test_broken_completions_are_caught(change: dict[str, Any], where: str) -> None:
    problems = completion_problems({**completion(), **change})
    assert problems and any(where in p for p in problems), problems


def test_stream_chunks_may_carry_null_finish_reason_and_usage_but_full_bodies_not() -> None:
    chunk = {**completion(finish_reason=None), "usage": None}
    assert completion_problems(chunk, stream=True) == []
    assert completion_problems(chunk) != []


def test_error_bodies_need_all_four_keys() -> None:
    assert error_problems({"error": {"message": "m", "type": "t", "param": None, "code": None}}) == []
    assert error_problems({"error": {"message": "m", "type": "t"}}) != []
    assert error_problems({"detail": "Not Found"}) != []


def sse(*payloads: Any) -> bytes:
    return b"".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads)


def test_sse_check_follows_frames_split_anywhere() -> None:
    body = sse({**completion(finish_reason=None), "usage": None}, completion(), "[DONE]")
    check = ResponseCheck("POST", "/v1/completions", 200, "text/event-stream")
    problems = [p for i in range(0, len(body), 7) for p in check.feed(body[i : i + 7])]
    assert problems + check.finish(read_to_end=True) == [] and check.checked


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (sse(completion()), "without `data: [DONE]`"),
        (sse("[DONE]", completion()), "after [DONE]"),
        (sse({"object": "text_completion"}, "[DONE]"), "required"),
        (b"data: {not json\n\ndata: [DONE]\n\n", "not JSON"),
        (sse({"error": {"message": "boom"}}, "[DONE]"), "error body"),
    ],
)
def test_sse_check_catches_broken_streams(body: bytes, problem: str) -> None:
    check = ResponseCheck("POST", "/v1/completions", 200, "text/event-stream")
    problems = check.feed(body) + check.finish(read_to_end=True)
    assert any(problem in p for p in problems), problems


def test_which_responses_are_checked() -> None:
    assert ResponseCheck("POST", "/v1/completions", 200, "application/json").kind == "completion"
    assert ResponseCheck("GET", "/v1/models", 404, "application/json").kind == "error"
    assert not ResponseCheck("GET", "/v1/models", 200, "application/json").active
    assert ResponseCheck("POST", "/v1/completions", 200, "application/json").finish(read_to_end=False) == []
