from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import MODEL, body
from tokenmill.api.errors import APIError
from tokenmill.api.protocol import CompletionRequest, parse_request
from tokenmill.engine.sampling import SamplingParams

TOO_LONG = list(range(3, 103)) * 2  # 200 token ids; the fake engine's context is 128

BAD_REQUESTS: list[tuple[dict[str, Any], int, str | None]] = [
    # (request body, status, param)
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    (body(model="gpt-9"), 404, "model"),
    (body(prompt=[]), 400, "prompt"),
    (body(prompt=[[]]), 400, "prompt"),
    (body(prompt=[[5], []]), 400, "prompt"),
    (body(prompt=[5, "a"]), 400, "prompt"),
    (body(prompt=[1.5]), 400, "prompt"),
    (body(prompt=[True]), 400, "prompt"),
    (body(prompt=5), 400, "prompt"),
    (body(prompt={"text": "hi"}), 400, "prompt"),
    (body(prompt=[5, 99999]), 400, "prompt"),
    (body(prompt=[-1]), 400, "prompt"),
    (body(prompt=[[5], [99999]]), 400, "prompt"),
    (body(prompt=TOO_LONG), 400, "prompt"),
    (body(max_tokens=126), 400, "max_tokens"),
    (body(max_tokens=-1), 400, "max_tokens"),
    (body(max_tokens=1.5), 400, "max_tokens"),
    (body(max_tokens="16"), 400, "max_tokens"),
    (body(temperature=-0.1), 400, "temperature"),
    (body(temperature=2.01), 400, "temperature"),
    (body(temperature="1"), 400, "temperature"),
    (body(top_p=1.01), 400, "top_p"),
    (body(top_p=-0.5), 400, "top_p"),
    (body(n=0), 400, "n"),
    (body(n=129), 400, "n"),
    (body(n=2.0), 400, "n"),
    (body(logprobs=6), 400, "logprobs"),
    (body(logprobs=-1), 400, "logprobs"),
    (body(best_of=0), 400, "best_of"),
    (body(best_of=21), 400, "best_of"),
    (body(best_of=2, n=3), 400, "best_of"),
    (body(best_of=2, stream=True), 400, "best_of"),
    (body(frequency_penalty=2.5), 400, "frequency_penalty"),
    (body(frequency_penalty=-2.5), 400, "frequency_penalty"),
    (body(presence_penalty=-3), 400, "presence_penalty"),
    (body(presence_penalty=2.1), 400, "presence_penalty"),
    (body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (body(stop=[]), 400, "stop"),
    (body(stop=[""]), 400, "stop"),
    (body(stop=""), 400, "stop"),
    (body(stop=5), 400, "stop"),
    (body(stop=["a", 5]), 400, "stop"),
    (body(logit_bias={"abc": 1}), 400, "logit_bias"),
    (body(logit_bias={"5": 101}), 400, "logit_bias"),
    (body(logit_bias={"5": -100.5}), 400, "logit_bias"),
    (body(logit_bias={"99999": 1}), 400, "logit_bias"),
    (body(logit_bias={"-1": 1}), 400, "logit_bias"),
    (body(logit_bias={"--5": 1}), 400, "logit_bias"),
    (body(logit_bias=[1, 2]), 400, "logit_bias"),
    (body(stream_options={"include_usage": True}), 400, "stream_options"),
    (body(stream=False, stream_options={"include_usage": True}), 400, "stream_options"),
    (body(stream=True, stream_options={"include_usage": True, "extra": 1}), 400, "stream_options.extra"),
    (body(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    (body(suffix="def f():"), 400, "suffix"),
    (body(seed=2**63), 400, "seed"),
    (body(seed=-(2**63) - 1), 400, "seed"),
    (body(seed="42"), 400, "seed"),
    (body(echo="yes"), 400, "echo"),
    (body(echo=1), 400, "echo"),
    (body(stream="true"), 400, "stream"),
    (body(user=5), 400, "user"),
    (body(mirostat=2), 400, "mirostat"),  # a knob no server we follow names so
    (body(frobnicate=True), 400, "frobnicate"),
]


@pytest.mark.parametrize(("payload", "status", "param"), BAD_REQUESTS)
def test_bad_request_is_rejected_naming_the_param(
    client: TestClient, payload: dict[str, Any], status: int, param: str | None
) -> None:
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(
    "raw",
    [b"{", b"", b"not json", b"[]", b"null", b'"text"', b'{"model": "fake-model", "prompt": "hi",}'],
)
def test_malformed_or_non_object_json_is_400(client: TestClient, raw: bytes) -> None:
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_400(client: TestClient, literal: bytes) -> None:
    raw = b'{"model": "fake-model", "prompt": "hi", "temperature": ' + literal + b"}"
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"


def test_context_error_states_both_numbers(client: TestClient) -> None:
    response = client.post("/v1/completions", json=body(prompt="hello", max_tokens=125))
    error = response.json()["error"]
    assert response.status_code == 400
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert "128" in error["message"] and "6 in your prompt" in error["message"] and "125" in error["message"]


def test_prompt_plus_max_tokens_may_fill_the_context_exactly(client: TestClient) -> None:
    response = client.post("/v1/completions", json=body(prompt=[1] + [5] * 119, max_tokens=8))  # 1: BOS
    assert response.status_code == 200, response.text


GOOD_REQUESTS: list[dict[str, Any]] = [
    body(),
    body(prompt=None),
    body(prompt=""),
    body(prompt=["a", ""]),
    body(prompt=[5, 6]),
    body(prompt=[[5], [6, 7]]),
    body(max_tokens=0),
    body(max_tokens=None, temperature=None, top_p=None, n=None, stop=None, logprobs=None, echo=None, best_of=None),
    body(temperature=0, top_p=0, n=128, max_tokens=1),
    body(temperature=2, top_p=1, frequency_penalty=-2, presence_penalty=2),
    body(best_of=20, n=20, max_tokens=1),
    body(best_of=1, stream=True),
    body(stop="x"),
    body(stop=["a", "b", "c", "d"]),
    body(logit_bias={"5": 100, "6": -100, "7": 0.5}),
    body(seed=2**63 - 1),
    body(seed=-(2**63)),
    body(suffix=""),
    body(user="user-1234"),
    body(stream=True, stream_options={"include_usage": False}),
    body(stream=True, stream_options=None),
]


@pytest.mark.parametrize("payload", GOOD_REQUESTS)
def test_valid_request_is_accepted(client: TestClient, payload: dict[str, Any]) -> None:
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text


SAMPLING: list[tuple[dict[str, Any], SamplingParams]] = [
    ({}, SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, n=1)),
    (
        {"max_tokens": 0, "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "\n"},
        SamplingParams(max_tokens=0, temperature=0.0, top_p=0.5, seed=7, stop=("\n",)),
    ),
    ({"n": 2, "best_of": 5}, SamplingParams(n=5)),
    ({"n": 3}, SamplingParams(n=3)),
    ({"logprobs": 2}, SamplingParams(logprobs=2, prompt_logprobs=None)),
    ({"logprobs": 0, "echo": True}, SamplingParams(logprobs=0, prompt_logprobs=0)),
    ({"echo": True}, SamplingParams(prompt_logprobs=None)),
    ({"logit_bias": {"5": 10, "7": -1.5}}, SamplingParams(logit_bias={5: 10.0, 7: -1.5})),
    ({"stop": ["a", "b"]}, SamplingParams(stop=("a", "b"))),
    ({"presence_penalty": 1, "frequency_penalty": -1}, SamplingParams(presence_penalty=1.0, frequency_penalty=-1.0)),
]


@pytest.mark.parametrize(("fields", "expected"), SAMPLING)
def test_to_sampling_params_resolves_openai_defaults(fields: dict[str, Any], expected: SamplingParams) -> None:
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields})
    assert request.to_sampling_params() == expected


def test_cross_field_errors_are_api_errors_even_outside_http() -> None:
    with pytest.raises(APIError) as caught:
        parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "n": 3, "best_of": 2}')
    assert (caught.value.status, caught.value.param) == (400, "best_of")


@pytest.mark.parametrize(
    ("fields", "quoted"),
    [
        ({"temperature": 3.5}, "(got 3.5)"),
        ({"n": "two"}, '(got "two")'),
        ({"echo": 1}, "(got 1)"),
        ({"logit_bias": {"--5": 1}}, 'got "--5"'),
        ({"user": 7}, "(got 7)"),
    ],
)
def test_a_bad_value_is_quoted_in_the_message(client: TestClient, fields: dict[str, Any], quoted: str) -> None:
    response = client.post("/v1/completions", json=body(**fields))
    assert response.status_code == 400 and quoted in response.json()["error"]["message"]


def test_a_long_bad_value_is_quoted_short(client: TestClient) -> None:
    response = client.post("/v1/completions", json=body(n="x" * 100_000))
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "xxx" in message and len(message) < 200
