"""The app's own OpenAPI document describes the real request bodies (what schemathesis fuzzes from), and describing
them changes nothing about how they are checked: bad values are still 400s naming the param, never FastAPI's 422."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import MODEL
from tests.openapi_contract import spec_schemas
from tokenmill.api.protocol import CompletionRequest

EXTENSIONS = (  # vLLM's names, after the reference's fields
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "return_token_ids",
    "structured_outputs",
    "response_format",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
    "use_beam_search",
    "length_penalty",
    "truncation_side",
    "cache_salt",
    "lora",
)


def request_schema(client: TestClient, path: str) -> dict[str, Any]:
    doc = client.get("/openapi.json").json()
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    schema: dict[str, Any] = body["content"]["application/json"]["schema"]
    return schema


def test_completion_request_schema_has_the_official_fields_in_order(client: TestClient) -> None:
    schema = request_schema(client, "/v1/completions")
    official = spec_schemas()["CreateCompletionRequest"]["properties"]
    assert list(schema["properties"]) == list(CompletionRequest.model_fields)
    # the reference's fields first, in its order, then the extensions (vLLM's names), each documented
    assert set(list(schema["properties"])[: len(official)]) == set(official)
    extensions = list(schema["properties"])[len(official) :]
    assert extensions == list(EXTENSIONS)
    assert all(schema["properties"][name].get("description") for name in EXTENSIONS)
    assert schema["additionalProperties"] is False and set(schema["required"]) == {"model", "prompt"}
    assert "$ref" not in str(schema)  # nested models are inlined: the document has no $defs to point at
    assert schema["properties"]["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 5}


@pytest.mark.parametrize(("path", "required"), [("/tokenize", ["prompt"]), ("/detokenize", ["tokens"])])
def test_tokenizer_route_schemas(client: TestClient, path: str, required: list[str]) -> None:
    schema = request_schema(client, path)
    assert schema["required"] == required and schema["additionalProperties"] is False


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_described_bodies_are_still_checked_by_the_protocol_layer(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
