"""`suffix` over HTTP on a tiny model whose tokenizer has fill-in-the-middle tokens (the real engine, not a fake)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import assert_openai_error
from tests.model.families import BY_NAME, SIZES, write_hf_model
from tests.tiny_model import tiny_fim_tokenizer, write_tokenizer_files
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine.engine import AsyncEngine
from tokenmill.server.load import load_engine
from tokenmill.tokenizer.fim import STYLES

PREFIX, SUFFIX = "def hello(", "):\n    return world\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, AsyncEngine]]:
    directory = tmp_path_factory.mktemp("fim")
    write_hf_model(directory, BY_NAME["llama"])
    write_tokenizer_files(directory, SIZES["max_position_embeddings"], tiny_fim_tokenizer(STYLES[0]))  # Qwen style
    config = Config(model=str(directory), cache_dir=str(directory / "cache"), dtype="float32", quantization="none")
    engine = load_engine(config)
    with TestClient(create_app(engine, config)) as client:
        yield client, engine


def complete(client: TestClient, engine: AsyncEngine, **fields: Any) -> dict[str, Any]:
    body = {"model": engine.model_name, "prompt": PREFIX, "suffix": SUFFIX, "temperature": 0, "max_tokens": 6}
    response = client.post("/v1/completions", json={**body, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_model_card_says_suffix_works(served: tuple[TestClient, AsyncEngine]) -> None:
    client, _ = served
    assert client.get("/v1/models").json()["data"][0]["supports_suffix"] is True


def test_the_prompt_is_laid_out_for_infilling_and_echo_returns_it_as_sent(
    served: tuple[TestClient, AsyncEngine],
) -> None:
    client, engine = served
    layout = engine.tokenizer.encode_infill(PREFIX, SUFFIX)
    out = complete(client, engine, echo=True, logprobs=0)
    assert out["usage"]["prompt_tokens"] == len(layout)
    choice = out["choices"][0]
    assert choice["text"].startswith(PREFIX)  # the prompt as sent, then the middle
    tokens = choice["logprobs"]["tokens"]  # one per token the model saw; those the echo leaves out are ""
    assert len(tokens) >= len(layout) and "".join(tokens) == choice["text"]
    assert "".join(tokens[: len(layout)]) == PREFIX  # the FIM tokens and the suffix's are not in the echo
    plain = complete(client, engine)
    assert choice["text"] == PREFIX + plain["choices"][0]["text"]


def test_the_middle_ends_at_an_end_of_middle_token(served: tuple[TestClient, AsyncEngine]) -> None:
    client, engine = served
    for end in engine.tokenizer.fim_end_ids:  # pushed to be the first token: the middle is over, and empty
        out = complete(client, engine, logit_bias={str(end): 100})
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["text"] == ""
    without = complete(client, engine, suffix=None, logit_bias={str(engine.tokenizer.fim_end_ids[0]): 100})
    assert without["choices"][0]["finish_reason"] == "length"  # outside infilling it is an ordinary token


def test_token_id_prompts_cannot_take_a_suffix(served: tuple[TestClient, AsyncEngine]) -> None:
    client, engine = served
    response = client.post("/v1/completions", json={"model": engine.model_name, "prompt": [5, 6], "suffix": "x"})
    assert assert_openai_error(response, 400)["param"] == "suffix"
