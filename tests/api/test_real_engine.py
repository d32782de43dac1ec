"""The app around the real AsyncEngine on the tiny random-weight model: the engine contract, not a fake's idea of it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, call_then_disconnect, parse_sse, run, tiny_engine
from tests.engine.tiny import NUM_SPECIAL, ByteTokenizer
from tokenmill.api.app import create_app
from tokenmill.config import Config


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_engine(), Config())) as test_client:  # the lifespan starts the step loop
        yield test_client


BOS = ByteTokenizer.bos_id


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": TINY_MODEL, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "Hello", "max_tokens": 8},
        {"prompt": ["Hello", "abc"], "max_tokens": 6, "n": 2, "logprobs": 2, "temperature": 0.8, "seed": 5},
        {"prompt": "Hi", "max_tokens": 4, "echo": True, "logprobs": 1},
    ],
)
def test_stream_joined_equals_non_stream(client: TestClient, fields: dict[str, Any]) -> None:
    plain = complete(client, **fields)
    response = client.post("/v1/completions", json={"model": TINY_MODEL, "temperature": 0, **fields, "stream": True})
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, list[str | None]] = {}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert all(f[-1] is not None and all(x is None for x in f[:-1]) for f in finishes.values())


def test_scoring_request_has_one_entry_per_prompt_token(client: TestClient) -> None:
    ids = client.post("/tokenize", json={"prompt": "Hi there"}).json()["tokens"]
    choice = complete(client, prompt=ids, max_tokens=0, echo=True, logprobs=1)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
    assert choice["text"] == "<bos>Hi there" and choice["finish_reason"] == "length"


def test_best_of_counts_every_candidate(client: TestClient) -> None:
    out = complete(client, prompt="Hi", max_tokens=5, best_of=3, temperature=1.0, seed=1)
    assert len(out["choices"]) == 1 and out["usage"]["completion_tokens"] == 15


def test_stats_count_the_steps_and_tokens_of_a_request(client: TestClient) -> None:
    before = client.get("/stats").json()
    no_eos = {"1": -100}  # ByteTokenizer.eos_id: the request runs to max_tokens
    out = complete(client, prompt="Counting steps", max_tokens=7, logit_bias=no_eos)
    after = client.get("/stats").json()
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (15, 7)  # <bos> + 14 bytes
    # one prefill step samples the first token, then one decode step per further token, less a step for each draft
    # token kept (where speculation is on); the last token sampled is never fed back, so it is never computed,
    # and each draft token refused was computed for nothing
    kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    refused = after["spec_draft_tokens"] - before["spec_draft_tokens"] - kept
    assert after["steps"] - before["steps"] == 7 - kept
    assert after["tokens_computed"] - before["tokens_computed"] == 15 + 7 - 1 + refused
    assert (after["num_running"], after["num_used_blocks"]) == (0, 0)
    assert after["weight_bytes_per_token"] == before["weight_bytes_per_token"] > 0  # the model's, not a counter


def test_disconnect_mid_stream_frees_the_kv_blocks() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, int]]:
        engine = tiny_engine()
        await engine.start()
        try:
            no_eos = {"1": -100}  # ByteTokenizer.eos_id: only the disconnect can end these early
            payload = {
                "model": TINY_MODEL,
                "prompt": ["Hello", "World"],
                "max_tokens": 400,
                "stream": True,
                "n": 2,
                "logit_bias": no_eos,
            }

            def after_first_chunk(sent: list[dict[str, Any]]) -> bool:
                return any(m["type"] == "http.response.body" and m.get("body") for m in sent)

            sent = await call_then_disconnect(create_app(engine, Config()), payload, after_first_chunk)
            while engine.stats().num_running or engine.stats().num_used_blocks:
                await asyncio.sleep(0.01)
            return sent, dataclasses.asdict(engine.stats())
        finally:
            await engine.stop()

    sent, stats = run(scenario)
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = parse_sse(raw)
    assert "[DONE]" not in events  # cut short
    chunks_per_choice = Counter(c["index"] for event in events for c in event["choices"])
    assert chunks_per_choice and stats["num_used_blocks"] == 0  # every block back
    # each chunk carries at least one token and each token of a choice takes its own step; 400 would be the full run
    assert max(chunks_per_choice.values()) <= stats["steps"] < 400
    assert stats["tokens_computed"] >= 2 * 6 + stats["steps"] - 2  # both prompts (<bos> + 5 bytes), then decodes


def test_token_ids_are_read_as_sent(client: TestClient) -> None:
    """Without BOS, the first id sent has no context: a null logprob (OpenAI's and vLLM's contract)."""
    sent = [NUM_SPECIAL + b for b in b"Hello there"]
    out = complete(client, prompt=sent, echo=True, logprobs=1, max_tokens=0, return_token_ids=True)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == sent and out["usage"]["prompt_tokens"] == len(sent)
    assert choice["text"] == "Hello there" == "".join(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"][0] is None


def test_add_bos_to_token_prompts_scores_ids_after_the_bos_the_model_needs() -> None:
    """--add-bos-to-token-prompts: ids without BOS are read after one (as evaluation harnesses need) and echoed as
    sent, each scored exactly as the same ids sent with the BOS."""
    sent = [NUM_SPECIAL + b for b in b"Hello there"]  # no BOS, as lm-evaluation-harness's remote tokenizer sends them
    with TestClient(create_app(tiny_engine(), Config(add_bos_to_token_prompts=True))) as client:
        with_bos = complete(client, prompt=[BOS, *sent], echo=True, logprobs=1, max_tokens=0)
        without = complete(client, prompt=sent, echo=True, logprobs=1, max_tokens=0)
    lp, full = without["choices"][0]["logprobs"], with_bos["choices"][0]["logprobs"]
    assert without["choices"][0]["text"] == "Hello there" == "".join(lp["tokens"])  # exactly what was sent
    assert lp["token_logprobs"] == full["token_logprobs"][1:]  # scored after the BOS: the first one too
    assert lp["top_logprobs"] == full["top_logprobs"][1:]
    assert without["usage"]["prompt_tokens"] == len(sent) + 1  # what the model read
    assert with_bos["usage"]["prompt_tokens"] == len(sent) + 1  # ids that start with BOS are read as they are


def test_text_offsets_count_from_the_prompts_start(client: TestClient) -> None:
    plain = complete(client, prompt="Hi", logprobs=0, max_tokens=4)["choices"][0]
    echoed = complete(client, prompt="Hi", logprobs=0, max_tokens=4, echo=True)["choices"][0]
    assert plain["logprobs"]["text_offset"][0] == len("Hi")  # OpenAI's: the first generated token's is the prompt's
    assert plain["logprobs"]["text_offset"] == echoed["logprobs"]["text_offset"][-4:]
    assert "".join(echoed["logprobs"]["tokens"]) == echoed["text"]  # the BOS the text leaves out is ""
