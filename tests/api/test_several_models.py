"""Several models in one server: each its own engine and id; a request's `model` picks one; `/health` covers all.

The routing is checked on fake engines (which one saw the request); the real build path on two tiny Hugging Face
directories served side by side, each with its own KV cache out of the shared --kv-cache-mb.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import assert_openai_error
from tests.api.fake_engine import FakeEngine
from tests.model.families import BY_NAME, write_hf_model
from tokenmill.api.app import create_app
from tokenmill.cli import main
from tokenmill.config import Config
from tokenmill.server.load import load_engine


@pytest.fixture
def pair() -> tuple[FakeEngine, FakeEngine]:
    return FakeEngine(model_name="alpha"), FakeEngine(model_name="beta")


@pytest.fixture
def client(pair: tuple[FakeEngine, FakeEngine]) -> Iterator[TestClient]:
    with TestClient(create_app(list(pair), Config()), raise_server_exceptions=False) as test_client:
        yield test_client


def completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hi", "max_tokens": 3, **fields}


def test_models_lists_every_model_in_the_order_given(client: TestClient) -> None:
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["alpha", "beta"]
    assert client.get("/v1/models/beta").json()["id"] == "beta"
    assert_openai_error(client.get("/v1/models/gamma"), 404, "model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_model_picks_the_engine(
    client: TestClient, pair: tuple[FakeEngine, FakeEngine], stream: bool
) -> None:
    alpha, beta = pair
    response = client.post("/v1/completions", json=completion("beta", stream=stream))
    assert response.status_code == 200, response.text
    assert '"model":"beta"' in response.text.replace(" ", "")
    assert (len(alpha.requests), len(beta.requests)) == (0, 1)
    client.post("/v1/completions", json=completion("alpha"))
    assert (len(alpha.requests), len(beta.requests)) == (1, 1)


def test_an_unknown_model_is_404_and_reaches_no_engine(client: TestClient, pair: tuple[FakeEngine, FakeEngine]) -> None:
    error = assert_openai_error(client.post("/v1/completions", json=completion("gamma")), 404, "model_not_found")
    assert error["param"] == "model" and "gamma" in error["message"]
    assert all(not engine.requests for engine in pair)


def test_tokenizer_routes_and_stats_take_the_model(client: TestClient, pair: tuple[FakeEngine, FakeEngine]) -> None:
    assert client.post("/tokenize", json={"model": "beta", "prompt": "ab"}).status_code == 200
    assert_openai_error(client.post("/tokenize", json={"model": "gamma", "prompt": "ab"}), 404, "model_not_found")
    assert client.post("/detokenize", json={"model": "alpha", "tokens": [5]}).status_code == 200
    assert client.get("/tokenizer_info", params={"model": "beta"}).status_code == 200
    assert_openai_error(client.get("/tokenizer_info", params={"model": "gamma"}), 404, "model_not_found")
    client.post("/v1/completions", json=completion("beta", n=2))
    assert client.get("/stats", params={"model": "beta"}).json()["requests"] == 1
    assert client.get("/stats").json()["requests"] == 0  # no model: the first one's
    assert_openai_error(client.get("/stats", params={"model": "gamma"}), 404, "model_not_found")


def test_health_needs_every_engine_and_names_the_sick_one(
    client: TestClient, pair: tuple[FakeEngine, FakeEngine]
) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    pair[1].healthy = False
    error = assert_openai_error(client.get("/health"), 503)
    assert "beta" in error["message"] and "alpha" not in error["message"]
    # the healthy model still serves; the sick one answers 503
    assert client.post("/v1/completions", json=completion("alpha")).status_code == 200
    assert_openai_error(client.post("/v1/completions", json=completion("beta")), 503)


def test_the_lifespan_starts_and_stops_every_engine() -> None:
    engines = [FakeEngine(model_name="alpha", healthy=False), FakeEngine(model_name="beta", healthy=False)]
    with TestClient(create_app(engines, Config())) as client:
        assert client.get("/health").status_code == 200
        assert [e.lifecycle for e in engines] == [["start"], ["start"]]
    assert [e.lifecycle for e in engines] == [["start", "stop"], ["start", "stop"]]


def test_two_models_under_one_id_are_refused() -> None:
    with pytest.raises(ValueError, match="same id"):
        create_app([FakeEngine(model_name="alpha"), FakeEngine(model_name="alpha")], Config())


def test_complete_takes_one_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["complete", "hi", "--model", "a.gguf", "--model", "b.gguf"])
    assert exited.value.code == 2
    assert "one --model" in capsys.readouterr().err


# --- the real build path ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("two")
    write_hf_model(root / "llama-dir", BY_NAME["llama"])
    write_hf_model(root / "qwen-dir", BY_NAME["qwen2"])
    return root / "llama-dir", root / "qwen-dir"


def test_two_real_models_serve_side_by_side_each_with_its_own_cache(two_dirs: tuple[Path, Path]) -> None:
    llama, qwen = two_dirs
    config = Config(
        model=(str(llama), f"coder={qwen}"),
        kv_cache_mb=3,
        kv_cache_weights=(2.0, 1.0),
        cache_dir=str(llama.parent / "cache"),
        dtype="float32",
        quantization="none",
    )
    engines = [load_engine(one) for one in config.per_model()]
    assert [e.model_name for e in engines] == ["llama-dir", "coder"]
    # the shared 3 MiB split 2:1 (each model's blocks sized from its own share and its own bytes per block)
    assert [one.kv_cache_mb for one in config.per_model()] == [2, 1]
    assert engines[0].core.blocks is not engines[1].core.blocks
    with TestClient(create_app(engines, config)) as client:
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["llama-dir", "coder"]
        for engine in engines:
            body = completion(engine.model_name, prompt="Hello there", temperature=0, max_tokens=4)
            first = client.post("/v1/completions", json=body).json()
            assert first["model"] == engine.model_name
            assert first["usage"]["completion_tokens"] == 4
            again = client.post("/v1/completions", json=body).json()
            assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, and only this model's cache
        # different random weights and vocabularies: the same prompt is not answered the same by both
        replies = [
            client.post(
                "/v1/completions",
                json=completion(e.model_name, prompt="Hello", temperature=0, max_tokens=8, logprobs=0),
            ).json()
            for e in engines
        ]
        assert replies[0]["choices"][0]["logprobs"] != replies[1]["choices"][0]["logprobs"]
