"""vLLM's request fields beyond the reference, over HTTP on the real engine (tiny random model, byte tokenizer):
each alone and in combination, stream and not, and each bad value a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, assert_openai_error, parse_sse, tiny_engine, with_client
from tests.engine.tiny import NUM_SPECIAL, ByteTokenizer
from tokenmill.api.app import create_app
from tokenmill.config import Config

EOS, BOS = ByteTokenizer.eos_id, ByteTokenizer.bos_id
PROMPT = "Hello"


def byte(char: str) -> int:
    return NUM_SPECIAL + ord(char)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_engine(), Config())) as test_client:
        yield test_client


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    body = {"model": TINY_MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 8, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def only(out: dict[str, Any]) -> dict[str, Any]:
    [choice] = out["choices"]
    return choice


def greedy_ids(client: TestClient, **fields: Any) -> list[int]:
    return list(only(complete(client, return_token_ids=True, **fields))["token_ids"])


# --- ending a completion ------------------------------------------------------------------------------------------
def test_min_tokens_holds_back_eos_then_lets_it_end(client: TestClient) -> None:
    eager = {"logit_bias": {str(EOS): 100}}  # EOS is by far the most likely token at every step
    assert only(complete(client, **eager))["finish_reason"] == "stop"
    assert complete(client, **eager)["usage"]["completion_tokens"] == 1
    held = complete(client, min_tokens=5, return_token_ids=True, **eager)
    assert held["usage"]["completion_tokens"] == 6  # five forced, then EOS at once
    assert only(held)["token_ids"][-1] == EOS and EOS not in only(held)["token_ids"][:5]
    assert (only(held)["finish_reason"], only(held)["stop_reason"]) == ("stop", None)  # EOS is no stop_reason


def test_ignore_eos_runs_to_max_tokens(client: TestClient) -> None:
    out = only(complete(client, ignore_eos=True, logit_bias={str(EOS): 100}, return_token_ids=True, max_tokens=4))
    assert out["token_ids"] == [EOS] * 4 and out["finish_reason"] == "length"
    assert out["text"] == ""  # special tokens are left out of the text by default
    shown = only(complete(client, ignore_eos=True, logit_bias={str(EOS): 100}, max_tokens=3, skip_special_tokens=False))
    assert shown["text"] == "<eos>" * 3


def test_stop_token_ids_end_with_the_id_as_stop_reason(client: TestClient) -> None:
    free = greedy_ids(client)
    stop_at = free[2]
    out = only(complete(client, stop_token_ids=[stop_at], return_token_ids=True))
    assert out["token_ids"] == free[: free.index(stop_at) + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_at)


def test_a_stop_string_is_the_stop_reason_and_can_stay_in_the_text(client: TestClient) -> None:
    forced = {"logit_bias": {str(byte("a")): 100}, "max_tokens": 6}  # "aaaaaa"
    cut = only(complete(client, stop=["aa"], **forced))
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == ("", "stop", "aa")
    kept = only(complete(client, stop=["aa"], include_stop_str_in_output=True, **forced))
    assert (kept["text"], kept["stop_reason"]) == ("aa", "aa")
    # looked for from the third token's text on: the first two tokens' "aa" stays, tokens three and four match
    late = complete(client, stop=["aa"], min_tokens=3, **forced)
    assert (only(late)["text"], only(late)["stop_reason"], late["usage"]["completion_tokens"]) == ("aa", "aa", 4)
    assert only(complete(client, **forced))["stop_reason"] is None  # length: no stop_reason


# --- what may be sampled ------------------------------------------------------------------------------------------
def test_allowed_token_ids_confine_greedy_and_sampled_choices(client: TestClient) -> None:
    allowed = [byte("x"), byte("y"), byte("z")]
    for fields in ({}, {"temperature": 1.0, "seed": 3, "n": 4}):
        out = complete(client, allowed_token_ids=allowed, return_token_ids=True, **fields)
        for choice in out["choices"]:
            assert set(choice["token_ids"]) <= set(allowed) and set(choice["text"]) <= set("xyz")


def test_bad_words_are_never_generated(client: TestClient) -> None:
    free = only(complete(client, max_tokens=12))["text"]
    word = free[:2]
    assert len(word) == 2 and word.strip()
    out = only(complete(client, max_tokens=12, bad_words=[word]))["text"]
    assert word not in out and out != free


def test_top_k_of_one_and_min_p_of_one_are_greedy(client: TestClient) -> None:
    greedy = only(complete(client, max_tokens=12))["text"]
    for knob in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = complete(client, max_tokens=12, temperature=1.5, n=3, seed=11, **knob)
        assert [c["text"] for c in sampled["choices"]] == [greedy] * 3, knob


def test_top_k_off_values_change_nothing(client: TestClient) -> None:
    base = complete(client, temperature=1.0, seed=2, max_tokens=10)
    for off in ({"top_k": 0}, {"top_k": -1}, {"min_p": 0.0}, {"repetition_penalty": 1.0}):
        assert complete(client, temperature=1.0, seed=2, max_tokens=10, **off)["choices"] == base["choices"], off


def test_repetition_penalty_discourages_the_prompt_and_repeats(client: TestClient) -> None:
    repeated = {"logit_bias": {str(byte("q")): 10.0}, "max_tokens": 10}
    plain = only(complete(client, **repeated))["text"]
    penalised = only(complete(client, repetition_penalty=50.0, **repeated))["text"]
    assert plain.count("q") > 1 and penalised.count("q") <= 1


def test_filters_change_no_greedy_choice_and_logprobs_stay_the_models_own(client: TestClient) -> None:
    """Knobs change what is chosen, never the reported distribution: a penalised completion's tokens, scored again
    through echo without any knob, get exactly the logprobs it reported."""
    base = only(complete(client, logprobs=1, max_tokens=6))
    assert only(complete(client, logprobs=1, max_tokens=6, top_k=3, min_p=0.01)) == base  # greedy: filters are moot
    out = only(complete(client, logprobs=0, max_tokens=6, repetition_penalty=1.5, return_token_ids=True))
    ids = out["prompt_token_ids"] + out["token_ids"]
    scored = only(complete(client, prompt=ids, echo=True, max_tokens=0, logprobs=0))["logprobs"]["token_logprobs"]
    assert scored[len(out["prompt_token_ids"]) :] == pytest.approx(out["logprobs"]["token_logprobs"], abs=1e-5)


# --- prompts and token ids ----------------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(client: TestClient) -> None:
    out = complete(client, prompt="abcdefgh", truncate_prompt_tokens=3, return_token_ids=True, echo=True)
    assert out["usage"]["prompt_tokens"] == 3
    assert only(out)["prompt_token_ids"] == [byte(c) for c in "fgh"] and only(out)["text"].startswith("fgh")
    tail = complete(client, prompt=[byte(c) for c in "fgh"])  # the kept tail alone, as token ids (no BOS)
    assert only(out)["text"][3:] == only(tail)["text"] != ""


def test_return_tokens_as_token_ids_names_tokens_and_alternatives_by_id(client: TestClient) -> None:
    fields = {"logprobs": 3, "echo": True, "return_token_ids": True, "max_tokens": 4}
    by_text = only(complete(client, **fields))
    by_id = only(complete(client, return_tokens_as_token_ids=True, **fields))
    ids = by_id["prompt_token_ids"] + by_id["token_ids"]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
    assert by_id["logprobs"]["token_logprobs"] == by_text["logprobs"]["token_logprobs"]
    assert by_id["logprobs"]["text_offset"] == by_text["logprobs"]["text_offset"]  # still indexes the text
    assert by_id["text"] == by_text["text"]
    for top in by_id["logprobs"]["top_logprobs"][1:]:
        assert top and all(key.startswith("token_id:") and key[9:].isdigit() for key in top)
        assert 3 <= len(top) <= 4  # ids never merge, as texts may


def test_truncation_side_right_keeps_the_first_tokens(client: TestClient) -> None:
    fields = {"truncate_prompt_tokens": 3, "return_token_ids": True, "echo": True, "max_tokens": 2}
    out = complete(client, prompt=[byte(c) for c in "abcdefgh"], truncation_side="right", **fields)
    assert out["usage"]["prompt_tokens"] == 3
    assert only(out)["prompt_token_ids"] == [byte(c) for c in "abc"] and only(out)["text"].startswith("abc")
    left = complete(client, prompt=[byte(c) for c in "abcdefgh"], truncation_side="left", **fields)
    assert only(left)["prompt_token_ids"] == [byte(c) for c in "fgh"]


def test_cache_salt_shares_cached_prompt_blocks_only_with_the_same_salt(client: TestClient) -> None:
    prompt = "A salted prompt long enough to fill several blocks of the prefix cache: " * 2
    cached = [
        complete(client, prompt=prompt, max_tokens=1, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"]
        for salt in ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {})
    ]
    assert cached[0] == 0 and cached[1] > 0  # the same salt: the blocks the first one computed
    assert cached[2] == 0 and cached[3] == 0  # another salt, or none: nothing of tenant-a's


def test_return_token_ids_stream_equals_non_stream(client: TestClient) -> None:
    fields = {"model": TINY_MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = client.post("/v1/completions", json=fields).json()
    events = parse_sse(client.post("/v1/completions", json={**fields, "stream": True}).text)
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            streamed.setdefault(c["index"], []).extend(c["token_ids"])
            if "prompt_token_ids" in c:
                assert c["index"] not in prompts  # once per choice, on its first chunk
                prompts[c["index"]] = c["prompt_token_ids"]
    for c in whole["choices"]:
        assert streamed[c["index"]] == c["token_ids"] and prompts[c["index"]] == c["prompt_token_ids"]
        assert len(c["token_ids"]) == 6
    assert whole["choices"][0]["prompt_token_ids"] == ByteTokenizer().encode("Hi")


def test_the_openai_client_sends_them_through_extra_body() -> None:
    engine = tiny_engine()
    app = create_app(engine, Config())

    async def use(client: openai.AsyncOpenAI) -> Any:
        await engine.start()  # on this event loop (the ASGI transport runs no lifespan)
        try:
            return await client.completions.create(
                model=TINY_MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0,
                extra_body={"stop_token_ids": [EOS], "top_k": 5, "return_token_ids": True, "min_tokens": 2},
            )
        finally:
            await engine.stop()

    out = with_client(app, use)
    choice = out.choices[0].model_dump()
    assert len(choice["token_ids"]) == out.usage.completion_tokens >= 2 and "stop_reason" in choice


def test_prompt_logprobs_in_vllms_shape_agree_with_echo(client: TestClient) -> None:
    ids = [BOS, *(byte(c) for c in "Hello there")]
    scored = complete(client, prompt=ids, prompt_logprobs=3, max_tokens=2)
    echo = only(complete(client, prompt=ids, echo=True, logprobs=3, max_tokens=0))["logprobs"]
    positions = only(scored)["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for position, token, want, top in zip(positions[1:], ids[1:], echo["token_logprobs"][1:], echo["top_logprobs"][1:]):
        assert position[str(token)]["logprob"] == pytest.approx(want, abs=1e-6)
        assert position[str(token)]["decoded_token"] == chr(token - NUM_SPECIAL)
        ranked = sorted(position.values(), key=lambda v: v["rank"])
        assert {1, 2, 3} <= {v["rank"] for v in ranked} and len(position) in (3, 4)  # the three likeliest + itself
        assert [v["logprob"] for v in ranked] == sorted((v["logprob"] for v in ranked), reverse=True)
        assert max(v["logprob"] for v in ranked) == pytest.approx(max(top.values()), abs=1e-6)
        if position[str(token)]["rank"] > 3:  # not among them: below all three
            assert want < min(v["logprob"] for v in ranked[:3])
    assert only(complete(client, prompt=ids, max_tokens=2)).get("prompt_logprobs") is None  # only when asked


def test_prompt_logprobs_stream_once_per_choice(client: TestClient) -> None:
    fields = {"model": TINY_MODEL, "prompt": "Hey", "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1, "n": 2}
    whole = client.post("/v1/completions", json=fields).json()
    events = parse_sse(client.post("/v1/completions", json={**fields, "stream": True}).text)
    seen: dict[int, Any] = {}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            if "prompt_logprobs" in c:
                assert c["index"] not in seen
                seen[c["index"]] = c["prompt_logprobs"]
    assert seen == {c["index"]: c["prompt_logprobs"] for c in whole["choices"]}


# --- bad values ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 1000.0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # max_tokens' default is 16
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [ByteTokenizer.vocab_size]}, "allowed_token_ids"),
        ({"allowed_token_ids": [EOS], "min_tokens": 1}, "allowed_token_ids"),
        ({"allowed_token_ids": [byte("a")], "bad_words": ["a"]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2, "suffix": "x"}, "truncate_prompt_tokens"),
        ({"return_token_ids": 1}, "return_token_ids"),
        ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "truncation_side"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_400s_naming_the_field(client: TestClient, fields: dict[str, Any], param: str) -> None:
    body = {"model": TINY_MODEL, "prompt": PROMPT, **fields}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert error["param"] == param, error
