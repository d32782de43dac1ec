"""LoRA adapters over HTTP, on the real engine and the tiny model: a request's `model` picks one, /v1/models lists
each with its `parent`, and with --allow-runtime-lora vLLM's routes load and unload them while serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.model.lora_adapters import make_adapter
from tests.tiny_model import write_tiny_model
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.server.load import load_engine

BASE = "tiny"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    root = tmp_path_factory.mktemp("lora")
    write_tiny_model(root / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").float()
    for seed, name in enumerate(["tuned", "terse"]):
        make_adapter(base, "gemma3", root / name, seed=seed, merge=False)
    return root


def serve(root: Path, **settings: Any) -> TestClient:
    config = Config(
        model=str(root / "hf"),
        served_model_name=(BASE,),
        cache_dir=str(root / "cache"),
        dtype="float32",
        kv_cache_ram_gb=0,
        **settings,
    )
    return TestClient(create_app(load_engine(config), config))


@pytest.fixture(scope="module")
def client(adapters: Path) -> Iterator[TestClient]:
    with serve(adapters, lora=(f"tuned={adapters / 'tuned'}",), allow_runtime_lora=True) as test_client:
        yield test_client


def complete(client: TestClient, model: str, status: int = 200) -> dict[str, Any]:
    body = {"model": model, "prompt": "the capital of France is", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    return response.json()


def test_models_lists_each_adapter_with_its_parent(client: TestClient, adapters: Path) -> None:
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards[BASE]["parent"] is None
    assert cards["tuned"]["parent"] == BASE and cards["tuned"]["root"] == str(adapters / "tuned")
    assert client.get("/v1/models/tuned").json() == cards["tuned"]


def test_a_requests_model_picks_the_adapter(client: TestClient) -> None:
    base, tuned = complete(client, BASE), complete(client, "tuned")
    assert tuned["model"] == "tuned" and base["model"] == BASE
    assert tuned["system_fingerprint"] != base["system_fingerprint"]  # other weights
    assert tuned["choices"][0]["logprobs"] != base["choices"][0]["logprobs"]
    assert complete(client, "tuned")["choices"] == tuned["choices"]
    assert complete(client, BASE)["choices"] == base["choices"]


def test_adapters_load_and_unload_while_serving(client: TestClient, adapters: Path) -> None:
    complete(client, "terse", status=404)
    load = {"lora_name": "terse", "lora_path": str(adapters / "terse")}
    response = client.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 200 and "terse" in response.text
    assert complete(client, "terse")["model"] == "terse"
    assert client.post("/v1/load_lora_adapter", json=load).status_code == 400  # loaded already
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "terse"}).status_code == 200
    assert complete(client, "terse", status=404)["error"]["code"] == "model_not_found"
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "terse"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(
    ("load", "param", "said"),
    [
        ({"lora_name": "x", "lora_path": "/nowhere/adapter"}, "lora_path", "no LoRA adapter at /nowhere/adapter"),
        ({"lora_name": BASE, "lora_path": "/nowhere"}, "lora_name", "the name of a model served"),
        ({"lora_name": "x"}, "lora_path", "lora_path"),
        ({"lora_name": "x", "lora_path": "p", "scale": 2}, "scale", "scale"),
    ],
)
def test_a_bad_load_is_a_400_that_says_why(client: TestClient, load: dict[str, Any], param: str, said: str) -> None:
    response = client.post("/v1/load_lora_adapter", json=load)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and said in error["message"]
    assert complete(client, BASE)["model"] == BASE  # and the server serves on


def test_the_runtime_routes_are_off_unless_asked_for(adapters: Path) -> None:
    with serve(adapters, lora=(f"tuned={adapters / 'tuned'}",)) as client:
        load = {"lora_name": "terse", "lora_path": str(adapters / "terse")}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 404
        assert complete(client, "tuned")["model"] == "tuned"


def test_llama_servers_lora_list_picks_an_adapter_too(client: TestClient) -> None:
    def run(lora: list[dict[str, Any]], model: str = BASE, status: int = 200) -> dict[str, Any]:
        body = {"model": model, "prompt": "the capital of France is", "max_tokens": 5, "temperature": 0, "lora": lora}
        response = client.post("/v1/completions", json={**body, "logprobs": 2})
        assert response.status_code == status, response.text
        return response.json()

    tuned, base = complete(client, "tuned"), complete(client, BASE)
    assert run([{"id": 0, "scale": 1}])["choices"] == tuned["choices"]
    assert run([{"id": 0, "scale": 1}], model="tuned")["choices"] == tuned["choices"]
    assert run([{"id": 0, "scale": 0}])["choices"] == base["choices"]
    for lora in ([{"id": 0, "scale": 0.5}], [{"id": 3, "scale": 1}]):
        assert run(lora, status=400)["error"]["param"] == "lora"


def test_metrics_count_each_adapters_tokens_under_its_name(client: TestClient) -> None:
    complete(client, "tuned")
    metrics = client.get("/metrics").text
    assert 'tokenmill_completion_tokens_total{model="tuned"}' in metrics
    assert f'tokenmill_completion_tokens_total{{model="{BASE}"}}' in metrics
