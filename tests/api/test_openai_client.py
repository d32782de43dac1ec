"""The official `openai` client against the app in-process: compatibility proved with the real thing."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi import FastAPI

from tests.api.api_helpers import MODEL, with_client
from tests.api.fake_engine import SCRIPT, FakeEngine, scripted_text
from tokenmill.api.app import create_app
from tokenmill.config import Config


@pytest.fixture
def app(engine: FakeEngine) -> FastAPI:
    return create_app(engine, Config())


def test_create_completion(app: FastAPI) -> None:
    async def use(client: openai.AsyncOpenAI) -> Any:
        return await client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=5, logprobs=1)

    completion = with_client(app, use)
    assert completion.object == "text_completion" and completion.system_fingerprint == "fp_fake"
    assert [c.text for c in completion.choices] == [scripted_text(j)[:5] for j in range(2)] * 2
    assert completion.choices[0].logprobs is not None and completion.choices[0].logprobs.tokens == list(SCRIPT[:5])
    assert completion.usage is not None and completion.usage.completion_tokens == 20
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_with_usage(app: FastAPI) -> None:
    async def use(client: openai.AsyncOpenAI) -> list[Any]:
        chunks = await client.completions.create(
            model=MODEL, prompt="x", max_tokens=100, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in chunks]

    chunks = with_client(app, use)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == SCRIPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(SCRIPT) + 1


def test_echo_scoring_request(app: FastAPI) -> None:
    async def use(client: openai.AsyncOpenAI) -> Any:
        return await client.completions.create(model=MODEL, prompt=[1, 40, 41], echo=True, logprobs=1, max_tokens=0)

    logprobs = with_client(app, use).choices[0].logprobs
    assert logprobs.token_logprobs == [None, -2.0, -2.0]
    assert logprobs.top_logprobs[0] is None


ERRORS: list[tuple[dict[str, Any], type[openai.APIStatusError], str | None]] = [
    ({"model": MODEL, "prompt": "x", "temperature": 3}, openai.BadRequestError, "temperature"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, openai.BadRequestError, "suffix"),
    ({"model": MODEL, "prompt": "x", "extra_body": {"mirostat": 2}}, openai.BadRequestError, "mirostat"),
    ({"model": "gpt-3.5-turbo-instruct", "prompt": "x"}, openai.NotFoundError, "model"),
]


@pytest.mark.parametrize(("kwargs", "error", "param"), ERRORS)
def test_errors_surface_as_typed_openai_exceptions(
    app: FastAPI, kwargs: dict[str, Any], error: type[openai.APIStatusError], param: str | None
) -> None:
    async def use(client: openai.AsyncOpenAI) -> None:
        await client.completions.create(**kwargs)

    with pytest.raises(error) as caught:
        with_client(app, use)
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == param


def test_wrong_api_key_is_an_authentication_error(engine: FakeEngine) -> None:
    app = create_app(engine, Config(api_key=("secret",)))

    async def use(client: openai.AsyncOpenAI) -> Any:
        return await client.models.list()

    with pytest.raises(openai.AuthenticationError):
        with_client(app, use, api_key="wrong")
    assert [m.id for m in with_client(app, use, api_key="secret").data] == [MODEL]
