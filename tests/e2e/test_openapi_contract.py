"""Every request field through the official `openai` client, stream and non-stream; each body checked by the schema.

The checking itself happens in contract.py's transport wrapper for every test of this tier; these requests make sure
each field and each response variant (echo, logprobs, n, best_of, usage chunks, errors) passes through it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.e2e import contract
from tests.e2e.server import MODEL, Server

VARIANTS: list[dict[str, Any]] = [  # each greedy or seeded, so the stream must repeat the non-streamed text
    {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
    {"prompt": ["Once upon a time", "def add(a, b):"], "max_tokens": 5, "n": 2, "temperature": 0.7, "seed": 3},
    {"prompt": [2, 651, 6037], "max_tokens": 4, "logprobs": 3, "top_p": 0.9, "seed": 1},
    {"prompt": "The cat sat on the mat.", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": "Count: one, two,", "max_tokens": 6, "echo": True, "logprobs": 0, "stop": [" four", "\n"], "seed": 11},
    {
        "prompt": "Hello",
        "max_tokens": 5,
        "presence_penalty": 1.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"1": -100},
        "user": "contract-test",
        "seed": 7,
    },
    {"prompt": None, "max_tokens": 3, "temperature": 0},
]


@pytest.mark.parametrize("fields", VARIANTS)
def test_every_field_streamed_and_not_matches_the_schema(server: Server, fields: dict[str, Any]) -> None:
    client = server.client()
    before = contract.CHECKED["bodies"]
    full = client.completions.create(model=MODEL, **fields)
    chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **fields))
    assert contract.CHECKED["bodies"] == before + 2  # both bodies went through the schema check
    assert full.usage is not None and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in full.choices}  # greedy or seeded: the same text either way


def test_best_of_response_matches_the_schema(server: Server) -> None:
    before = contract.CHECKED["bodies"]
    r = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, best_of=3, n=2, seed=5)
    assert len(r.choices) == 2 and contract.CHECKED["bodies"] == before + 1


def test_async_client_responses_are_checked_too(server: Server) -> None:
    async def go() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
            stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, stream=True)
            return [r.choices[0].text, "".join([c.choices[0].text async for c in stream])]

    before = contract.CHECKED["bodies"]
    texts = asyncio.run(asyncio.wait_for(go(), 120))
    assert texts[0] == texts[1] and contract.CHECKED["bodies"] == before + 2


@pytest.mark.parametrize(
    ("fields", "error_class", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"suffix": "x"}, openai.BadRequestError, "suffix"),
        ({"logprobs": 9}, openai.BadRequestError, "logprobs"),
        ({"max_tokens": 10**6}, openai.BadRequestError, "max_tokens"),
    ],
)
def test_errors_raise_the_client_error_class_and_match_the_schema(
    server: Server, fields: dict[str, Any], error_class: type[openai.APIStatusError], param: str
) -> None:
    before = contract.CHECKED["bodies"]
    with pytest.raises(error_class) as raised:
        server.client().completions.create(**{"model": MODEL, "prompt": "x", **fields})
    assert raised.value.body is not None and raised.value.body["param"] == param  # type: ignore[index]
    raw = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", **fields}, timeout=30)
    assert raw.status_code == raised.value.status_code
    assert contract.CHECKED["bodies"] == before + 2
