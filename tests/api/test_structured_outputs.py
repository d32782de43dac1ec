"""Structured outputs over HTTP on the real engine: a tiny random Llama with the tiny tokenizers-backed vocabulary,
so every choice's text is what the grammar allows, whatever the random weights would rather say."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.api_helpers import TIMEOUT, assert_openai_error, body, get, parse_sse, post, run, with_client
from tests.api.fake_engine import FakeEngine
from tests.model.families import BY_NAME, write_hf_model
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine import guided
from tokenmill.engine.guided import GuideError
from tokenmill.server.load import load_engine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    directory: Path = tmp_path_factory.mktemp("structured")
    write_hf_model(directory, BY_NAME["llama"])
    config = Config(model=str(directory), cache_dir=str(directory / "cache"), dtype="float32", quantization="none")
    engine = load_engine(config)
    with TestClient(create_app(engine, config)) as client:
        yield client, engine.model_name


def complete(served: tuple[TestClient, str], **fields: Any) -> dict[str, Any]:
    client, model = served
    body = {"model": model, "prompt": "hello", "max_tokens": 48, "temperature": 1.0, "seed": 3, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def texts(out: dict[str, Any]) -> list[str]:
    assert all(c["finish_reason"] == "stop" for c in out["choices"]), out["choices"]
    return [c["text"] for c in out["choices"]]


def test_json_schema_outputs_validate(served: tuple[TestClient, str]) -> None:
    for constraint in ({"structured_outputs": {"json": SCHEMA}}, {"response_format": json_schema_format(SCHEMA)}):
        for text in texts(complete(served, n=3, **constraint)):
            jsonschema.validate(json.loads(text), SCHEMA)


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_object_is_an_object(served: tuple[TestClient, str]) -> None:
    out = complete(served, response_format={"type": "json_object"}, max_tokens=64, temperature=0.7, n=2)
    for choice in out["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
        else:  # max_tokens ran out first: what there is begins an object
            assert choice["finish_reason"] == "length" and choice["text"].startswith("{")


def test_regex_choice_and_grammars(served: tuple[TestClient, str]) -> None:
    assert all(
        re.fullmatch(r"[ab]{2,4}c", t) for t in texts(complete(served, structured_outputs={"regex": "[ab]{2,4}c"}, n=4))
    )
    assert set(texts(complete(served, structured_outputs={"choice": ["red", "green", "blue"]}, n=6))) <= {
        "red",
        "green",
        "blue",
    }
    lark = 'start: "the " ANIMAL\nANIMAL: "cat" | "dog"'
    gbnf = 'root ::= "the " animal\nanimal ::= "cat" | "dog"'
    for grammar in (lark, gbnf):
        assert set(texts(complete(served, structured_outputs={"grammar": grammar}, n=3))) <= {"the cat", "the dog"}


def test_with_stream_echo_logprobs_and_seed(served: tuple[TestClient, str]) -> None:
    client, model = served
    constraint = {"structured_outputs": {"regex": "(yes|no)!"}, "logprobs": 1, "echo": True, "n": 2, "seed": 9}
    whole = complete(served, **constraint)
    again = complete(served, **constraint)
    assert whole["choices"] == again["choices"]  # seeded: the same alone and again
    body = {"model": model, "prompt": "hello", "max_tokens": 48, "temperature": 1.0, **constraint, "stream": True}
    events = parse_sse(client.post("/v1/completions", json=body).text)
    streamed: dict[int, str] = {}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {c["index"]: c["text"] for c in whole["choices"]}
    for c in whole["choices"]:
        assert c["text"].startswith("hello") and re.fullmatch("(yes|no)!", c["text"][len("hello") :])


def test_max_tokens_first_is_length(served: tuple[TestClient, str]) -> None:
    out = complete(served, structured_outputs={"regex": "a{20}"}, max_tokens=3)
    assert out["choices"][0]["finish_reason"] == "length" and re.fullmatch("a*", out["choices"][0]["text"])


def test_a_constrained_row_leaves_a_free_one_alone(served: tuple[TestClient, str]) -> None:
    """A free request gets the same text alone as while constrained requests run beside it (same steps)."""
    alone = complete(served, max_tokens=12, temperature=0, logprobs=1)["choices"]
    constrained = {"structured_outputs": {"regex": "[xy]{12}"}, "n": 2, "logprobs": 1}
    seeded_alone = complete(served, **constrained)["choices"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, served, **constrained) for _ in range(3)]
        beside = pool.submit(complete, served, max_tokens=12, temperature=0, logprobs=1)
        assert beside.result()["choices"] == alone
        # and the seeded constrained requests give under load what they give alone
        assert all(f.result()["choices"] == seeded_alone for f in futures)
    assert all(re.fullmatch("[xy]{12}", t) for t in texts({"choices": seeded_alone}))


def test_with_best_of_and_stop(served: tuple[TestClient, str]) -> None:
    best = complete(served, structured_outputs={"choice": ["alpha", "beta", "gamma"]}, best_of=3, n=1)
    assert texts(best)[0] in {"alpha", "beta", "gamma"}
    cut = complete(served, structured_outputs={"regex": "ab(c|d)e"}, stop=["c", "d"])["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("ab", "stop")  # the stop string ends it inside the grammar


def test_the_openai_client_sends_them_through_extra_body(tmp_path: Path) -> None:
    write_hf_model(tmp_path, BY_NAME["llama"])
    config = Config(model=str(tmp_path), cache_dir=str(tmp_path / "cache"), dtype="float32", quantization="none")
    engine = load_engine(config)
    app = create_app(engine, config)

    async def use(client: openai.AsyncOpenAI) -> Any:
        await engine.start()  # on this event loop (the ASGI transport runs no lifespan)
        try:
            plain = await client.completions.create(
                model=engine.model_name,
                prompt="hi",
                max_tokens=40,
                extra_body={"response_format": json_schema_format(SCHEMA)},
            )
            stream = await client.completions.create(
                model=engine.model_name,
                prompt="hi",
                max_tokens=40,
                stream=True,
                extra_body={"structured_outputs": {"choice": ["left", "right"]}},
            )
            return plain, "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        finally:
            await engine.stop()

    plain, streamed = with_client(app, use)
    jsonschema.validate(json.loads(plain.choices[0].text), SCHEMA)
    assert streamed in {"left", "right"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: ( unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    served: tuple[TestClient, str], fields: dict[str, Any], param: str
) -> None:
    client, model = served
    error = assert_openai_error(client.post("/v1/completions", json={"model": model, "prompt": "x", **fields}), 400)
    assert error["param"].split(".")[0] == param, error  # a nested unknown key is named in full


# --- property: random simple regexes and schemas are always met -----------------------------------------------------
atoms = st.sampled_from(["a", "b", "c", "[ab]", "[a-c]", "(ab|c)", "x?"])
regexes = st.lists(st.tuples(atoms, st.sampled_from(["", "{1,3}", "+"])), min_size=1, max_size=4).map(
    lambda parts: "".join(a + (q if not a.endswith("?") else "") for a, q in parts) + "!"
)
schemas = st.fixed_dictionaries(
    {"k": st.sampled_from([{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["u", "v"]}])}
).map(lambda props: {"type": "object", "properties": props, "required": ["k"], "additionalProperties": False})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=regexes, seed=st.integers(0, 1000))
def test_random_regexes_are_always_matched(served: tuple[TestClient, str], pattern: str, seed: int) -> None:
    out = complete(served, structured_outputs={"regex": pattern}, seed=seed, max_tokens=40)
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":
        assert re.fullmatch(pattern, choice["text"]), (pattern, choice["text"])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 1000))
def test_random_schemas_are_always_met(served: tuple[TestClient, str], schema: dict[str, Any], seed: int) -> None:
    [text] = texts(complete(served, structured_outputs={"json": schema}, seed=seed))
    jsonschema.validate(json.loads(text), schema)


def test_the_grammar_tokenizer_is_built_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance's view of a tokenizer takes seconds to build for a large vocabulary: meanwhile other requests are
    answered. The build below waits for /health's answer, which could never come if it ran on the event loop."""
    building, answered = threading.Event(), threading.Event()

    def slow_build(tokenizer: Any) -> Any:
        building.set()
        if not answered.wait(TIMEOUT):
            raise AssertionError("/health was not answered while the grammar tokenizer was being built")
        raise GuideError("no tokenizer.json")  # the fake's tokenizer could not drive a grammar anyway

    monkeypatch.setattr(guided, "ll_tokenizer", slow_build)
    app = create_app(FakeEngine(), Config())

    async def go() -> tuple[int, int]:
        constrained = asyncio.create_task(post(app, "/v1/completions", body(structured_outputs={"regex": "a+"})))
        await asyncio.to_thread(building.wait, TIMEOUT)
        health = await get(app, "/health")
        answered.set()
        return health.status_code, (await constrained).status_code

    assert run(go) == (200, 400)


# --- constraints too large or too complex: 400s naming the field, with a short message ------------------------------
def test_a_constraint_past_the_size_bound_is_refused_before_llguidance_reads_it(served: tuple[TestClient, str]) -> None:
    client, model = served
    enum = {"enum": [f"value-{i:06d}" for i in range(guided.MAX_GUIDE_CHARS // 10)]}
    choices = ["c" * 1000] * (guided.MAX_GUIDE_CHARS // 1000 + 1)
    for fields, param, words in [
        ({"response_format": json_schema_format(enum)}, "response_format", "characters as a grammar"),
        ({"structured_outputs": {"choice": choices}}, "structured_outputs", "characters together"),
    ]:
        response = client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, **fields})
        error = assert_openai_error(response, 400)
        assert error["param"] == param and words in error["message"], error


def test_a_grammar_that_outgrows_the_matcher_while_generating_is_a_short_400(served: tuple[TestClient, str]) -> None:
    """3000 alternatives pass llguidance's check, then overflow its parser's row once the text starts ("["): the
    client's grammar, not the engine, is at fault, and the answer quotes none of the grammar."""
    client, model = served
    schema = {"anyOf": [{"type": "array", "items": {"type": "integer"}, "minItems": i} for i in range(3000)]}
    for stream in (False, True):
        payload = {"model": model, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}}
        response = client.post("/v1/completions", json={**payload, "stream": stream})
        if stream:
            error = parse_sse(response.text)[-2]["error"]
        else:
            error = assert_openai_error(response, 400)
        assert error["param"] == "structured_outputs" and error["type"] == "invalid_request_error", error
        assert "'structured_outputs' cannot be used" in error["message"] and len(error["message"]) < 500
    assert client.get("/health").status_code == 200
