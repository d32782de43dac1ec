"""Rate limits over HTTP: the 429 with its code, Retry-After and OpenAI's x-ratelimit-* headers on every completions
answer; per key and per user; tokens charged as prompt + max_tokens x sequences with the unused part refunded; what
is not charged; and the official client's RateLimitError. The limiter's clock is the test's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import (
    MODEL,
    TINY_MODEL,
    assert_openai_error,
    body,
    get,
    parse_sse,
    post,
    run,
    stream,
    tiny_engine,
    with_client,
)
from tests.api.fake_engine import FakeEngine
from tests.api.rate_limit_helpers import RATE_HEADERS, FakeClock, limited_app, rate_headers
from tests.api.scrape import parse, value
from tokenmill.api.app import create_app
from tokenmill.api.rate_limit import OTHER
from tokenmill.api.record import pseudonym
from tokenmill.config import Config

BAD = body(n=0)  # a 400 that charges nothing: a way to read the headers


def complete(app: Any, payload: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return run(lambda: post(app, "/v1/completions", payload, headers))


def test_a_key_over_its_request_limit_gets_429_with_the_code_and_headers() -> None:
    engine = FakeEngine()
    app = limited_app(Config(rate_limit_requests="3/min"), FakeClock(), engine)
    answers = [complete(app, body(max_tokens=2)) for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 3
    assert [rate_headers(r.headers) for r in answers] == [
        {"limit-requests": "3", "remaining-requests": "2", "reset-requests": "20s"},
        {"limit-requests": "3", "remaining-requests": "1", "reset-requests": "40s"},
        {"limit-requests": "3", "remaining-requests": "0", "reset-requests": "1m0s"},
    ]
    response = complete(app, body(max_tokens=2))
    error = assert_openai_error(response, 429, "rate_limit_exceeded")
    assert error["type"] == "requests"
    assert "Limit 3, Remaining 0, Requested 1" in error["message"]
    assert response.headers["retry-after"] == "20"
    assert rate_headers(response.headers) == {
        "limit-requests": "3",
        "remaining-requests": "0",
        "reset-requests": "1m0s",
    }
    assert len(engine.requests) == 3  # the refused one never reached the engine


def test_a_key_out_of_requests_is_refused_before_its_prompts_are_read() -> None:
    app = limited_app(Config(rate_limit_requests="1/min"), FakeClock())
    assert complete(app, body()).status_code == 200
    assert_openai_error(complete(app, body(prompt=[100000])), 429, "rate_limit_exceeded")  # not the prompt's 400


def test_retry_after_and_reset_follow_the_clock() -> None:
    clock = FakeClock()
    app = limited_app(Config(rate_limit_requests="2/min"), clock)
    for _ in range(2):
        assert complete(app, body()).status_code == 200
    clock.advance(25)  # one request back after 30 s
    response = complete(app, body())
    assert response.status_code == 429 and response.headers["retry-after"] == "5"
    assert rate_headers(response.headers)["reset-requests"] == "35s"
    assert "try again in 5s" in response.json()["error"]["message"]
    clock.advance(5)
    response = complete(app, body())
    assert response.status_code == 200
    assert rate_headers(response.headers) == {
        "limit-requests": "2",
        "remaining-requests": "0",
        "reset-requests": "1m0s",
    }


def test_users_of_one_key_are_limited_apart_and_the_key_binds_them_together() -> None:
    config = Config(rate_limit_requests="3/min", rate_limit_user_requests="2/min")
    app = limited_app(config, FakeClock())
    assert [complete(app, body(user="alice")).status_code for _ in range(2)] == [200, 200]
    alice = complete(app, body(user="alice"))
    assert_openai_error(alice, 429, "rate_limit_exceeded")
    assert "this `user`" in alice.json()["error"]["message"]
    assert rate_headers(alice.headers)["remaining-requests"] == "0"
    bob = complete(app, body(user="bob"))
    assert bob.status_code == 200  # alice's 429 did not touch bob, nor charge the key
    assert rate_headers(bob.headers) == {"limit-requests": "3", "remaining-requests": "0", "reset-requests": "1m0s"}
    bob = complete(app, body(user="bob"))  # bob has one left of his own, but the key has none
    assert_openai_error(bob, 429, "rate_limit_exceeded")
    assert "this API key" in bob.json()["error"]["message"]


def test_metrics_count_each_429_under_the_limit_that_refused_it() -> None:
    config = Config(rate_limit_requests="3/min", rate_limit_user_requests="2/min", metrics_public=True)
    app = limited_app(config, FakeClock())
    statuses = [complete(app, body(user=user)).status_code for user in ("alice", "alice", "alice", "bob", "bob")]
    assert statuses == [200, 200, 429, 200, 429]  # alice's own limit, then the key's
    samples = parse(run(lambda: get(app, "/metrics")).text)
    reasons = ("key_requests", "user_requests", "key_tokens", "busy_requests")
    assert [value(samples, "tokenmill_rate_limited_total", reason=r) for r in reasons] == [1, 1, 0, 0]
    assert value(samples, "tokenmill_user_requests", user=pseudonym("alice")) == 2  # finished ones only
    assert value(samples, "tokenmill_user_requests", user=pseudonym("bob")) == 1
    assert value(samples, "tokenmill_user_requests", user=OTHER) == 0
    assert "alice" not in run(lambda: get(app, "/metrics")).text


def test_keys_are_limited_apart() -> None:
    app = limited_app(Config(api_key=("key-a", "key-b"), rate_limit_requests="1/min"), FakeClock())
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    assert complete(app, body(), a).status_code == 200
    assert complete(app, body(), a).status_code == 429
    response = complete(app, body(), b)
    assert response.status_code == 200 and rate_headers(response.headers)["remaining-requests"] == "0"
    unauthenticated = complete(app, body(), {"Authorization": "Bearer nope"})
    assert unauthenticated.status_code == 401 and rate_headers(unauthenticated.headers) == {}


def test_tokens_are_prompt_plus_max_tokens_per_sequence_and_the_unused_part_comes_back() -> None:
    app = limited_app(Config(rate_limit_tokens="100/min"), FakeClock())
    # "hi" is 3 tokens with BOS; each of 2 sequences writes all 5 of its max_tokens: nothing to refund
    full = complete(app, body(max_tokens=5, n=2))
    assert full.json()["usage"]["total_tokens"] == 13
    assert rate_headers(full.headers)["remaining-tokens"] == "87"
    # charged 3 + 20, but the stop string ends it after "The " (4 tokens): 16 come back before the answer goes out
    early = complete(app, body(max_tokens=20, stop=[" "]))
    assert early.json()["usage"]["total_tokens"] == 7
    assert rate_headers(early.headers) == {"limit-tokens": "100", "remaining-tokens": "80", "reset-tokens": "12s"}
    # best_of: every candidate may write max_tokens
    best = complete(app, body(max_tokens=3, best_of=2))
    assert best.json()["usage"]["total_tokens"] == 3 + 2 * 3
    assert rate_headers(best.headers)["remaining-tokens"] == "71"


def test_a_stream_carries_the_headers_from_its_start_and_costs_what_the_same_request_unstreamed_does() -> None:
    app = limited_app(Config(rate_limit_requests="10/min", rate_limit_tokens="100/min"), FakeClock())
    payload = body(max_tokens=20, stop=[" "], stream=True, stream_options={"include_usage": True})
    response, events = stream(app, payload)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["usage"]["total_tokens"] == 7
    # sent before a token was generated: the whole budget (3 + 20) charged
    assert rate_headers(response.headers) == {
        "limit-requests": "10",
        "remaining-requests": "9",
        "reset-requests": "6s",
        "limit-tokens": "100",
        "remaining-tokens": "77",
        "reset-tokens": "13.8s",
    }
    after = complete(app, BAD)
    assert_openai_error(after, 400)
    assert rate_headers(after.headers)["remaining-tokens"] == "93"  # refunded to the 7 it used
    unstreamed = complete(app, body(max_tokens=20, stop=[" "]))
    assert rate_headers(unstreamed.headers)["remaining-tokens"] == "86"


def test_a_request_over_the_remaining_tokens_is_refused_and_one_over_the_limit_can_never_run() -> None:
    engine = FakeEngine()
    app = limited_app(Config(rate_limit_tokens="50/min"), FakeClock(), engine)
    assert complete(app, body(max_tokens=37)).status_code == 200  # 3 + 37 charged and used: 10 left
    # 15 wanted; "hi" can be no fewer than 2 tokens (1 + BOS), prepaid for its tokenising: 13 more do not fit in 8
    response = complete(app, body(max_tokens=12))
    error = assert_openai_error(response, 429, "rate_limit_exceeded")
    assert error["type"] == "tokens" and response.headers["retry-after"] == "6"  # 5 tokens back at 50 a minute
    assert rate_headers(response.headers) == {"limit-tokens": "50", "remaining-tokens": "8", "reset-tokens": "50.4s"}
    huge = complete(app, body(max_tokens=48))  # 51 > 50: no wait will do (its 2 prepaid tokens stay charged)
    error = assert_openai_error(huge, 429, "rate_limit_exceeded")
    assert error["message"].startswith("Request too large for this API key on tokens per min: Limit 50, Requested 51")
    assert "retry-after" not in huge.headers and rate_headers(huge.headers)["remaining-tokens"] == "6"
    assert len(engine.requests) == 1


@pytest.mark.parametrize(
    ("payload", "prepaid"),
    [(body(prompt=[100000]), "999"), (body(max_tokens=200), "998")],
    ids=["token-outside-vocabulary", "over-the-context"],
)
def test_a_request_refused_once_prepared_keeps_its_request_and_prompt_tokens_charged(
    payload: dict[str, Any], prepaid: str
) -> None:
    """Preparing a request (tokenising it, its vocabulary and context checks) is paid for before it is done: the
    request and the fewest tokens its prompt can be (a token-id prompt: its length; "hi": 1 + BOS)."""
    app = limited_app(Config(rate_limit_requests="5/min", rate_limit_tokens="1000/min"), FakeClock())
    assert_openai_error(complete(app, payload), 400)
    headers = rate_headers(complete(app, BAD).headers)
    assert (headers["remaining-requests"], headers["remaining-tokens"]) == ("4", prepaid)


def test_a_key_cannot_have_text_tokenised_past_its_token_limit() -> None:
    """A text whose fewest possible tokens do not fit what is left is refused before it is tokenised, at no cost;
    one that fits is charged that many before it is."""
    engine = FakeEngine(max_model_len=100_000)
    app = limited_app(Config(rate_limit_tokens="100/min"), FakeClock(), engine)
    calls = spy_on_encode(engine)
    long_text = "x" * 5000  # at least 5000 / 20 + 1 = 251 tokens for the fake's vocabulary: over the limit
    response = complete(app, body(prompt=long_text))
    error = assert_openai_error(response, 429, "rate_limit_exceeded")
    assert "Requested 251" in error["message"] and calls == []
    assert rate_headers(response.headers)["remaining-tokens"] == "100"
    refused = complete(app, body(prompt="x" * 1500))  # at least 76, prepaid; then 1501 + 16 tokens: too large
    assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert len(calls) == 1 and rate_headers(refused.headers)["remaining-tokens"] == "24"
    assert_openai_error(complete(app, body(prompt="x" * 1500)), 429, "rate_limit_exceeded")  # 76 > 24: not tokenised
    assert len(calls) == 1 and engine.requests == []


def spy_on_encode(engine: FakeEngine) -> list[int]:
    """The lengths of the texts the engine's tokenizer encodes from now on."""
    calls: list[int] = []
    encode = engine.tokenizer.encode

    def spied(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(len(text))
        return encode(text, add_special_tokens)

    engine.tokenizer.encode = spied  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    "payload",
    [body(n=0), body(model="gpt-nope"), {"model": MODEL}],
    ids=["bad-n", "unknown-model", "no-prompt-field"],
)
def test_a_refused_request_is_not_charged_but_carries_the_headers(payload: dict[str, Any]) -> None:
    app = limited_app(Config(rate_limit_requests="5/min", rate_limit_tokens="1000/min"), FakeClock())
    response = complete(app, payload)
    assert response.status_code in (400, 404)
    assert rate_headers(response.headers) == {
        "limit-requests": "5",
        "remaining-requests": "5",
        "reset-requests": "0s",
        "limit-tokens": "1000",
        "remaining-tokens": "1000",
        "reset-tokens": "0s",
    }


def test_a_request_the_server_is_too_busy_to_admit_is_not_charged() -> None:
    engine = FakeEngine(hang_at_step=0)  # the first request stays waiting, so admission refuses the second
    app = limited_app(Config(max_waiting_requests=1, rate_limit_requests="5/min"), FakeClock(), engine)

    async def hold_then_probe() -> httpx.Response:
        held = asyncio.create_task(post(app, "/v1/completions", body()))
        while app.state.admission.waiting_requests < 1:
            await asyncio.sleep(0.001)
        try:
            return await post(app, "/v1/completions", body())
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)

    response = run(hold_then_probe)
    assert_openai_error(response, 429, "rate_limit_exceeded")
    assert response.headers["retry-after"] == "1"  # admission's, not the rate limit's
    assert rate_headers(response.headers)["remaining-requests"] == "4"  # only the held request was charged


def test_no_headers_when_limits_are_off() -> None:
    app = create_app(FakeEngine(), Config())
    for response in (complete(app, body()), complete(app, BAD), stream(app, body(stream=True))[0]):
        assert not set(RATE_HEADERS) & set(response.headers)


def test_finished_requests_are_counted_per_user_for_metrics() -> None:
    app = limited_app(Config(rate_limit_requests="10/min"), FakeClock())
    complete(app, body(user="alice", max_tokens=5))
    complete(app, body(user="alice", max_tokens=5, n=2))
    complete(app, body(max_tokens=5))  # no user: no row
    complete(app, BAD | {"user": "bob"})  # refused: not counted
    rows = [(r.user, r.requests, r.tokens) for r in app.state.user_usage.rows()]
    assert rows == [(pseudonym("alice"), 2, 8 + 13), (OTHER, 0, 0)]


def test_the_openai_client_sees_a_rate_limit_error() -> None:
    app = limited_app(Config(api_key=("sk-x",), rate_limit_requests="1/min"), FakeClock())

    async def twice(client: openai.AsyncOpenAI) -> None:
        first = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
        assert first.headers["x-ratelimit-remaining-requests"] == "0"
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)

    with pytest.raises(openai.RateLimitError) as caught:
        with_client(app, twice, api_key="sk-x")
    error = caught.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.response.headers["retry-after"] == "60"
    assert error.response.headers["x-ratelimit-reset-requests"] == "1m0s"


def test_the_tiny_engine_is_charged_its_usage_streamed_or_not() -> None:
    app = limited_app(Config(rate_limit_tokens="1000/min"), FakeClock(), tiny_engine())
    # EOS (id 1) is forced once min_tokens allows it: the request ends long before its max_tokens
    payload = {"model": TINY_MODEL, "prompt": "Hello", "max_tokens": 30, "min_tokens": 3, "logit_bias": {"1": 100}}
    with TestClient(app) as client:  # the lifespan starts the step loop
        plain = client.post("/v1/completions", json=payload)
        streamed = client.post(
            "/v1/completions", json=payload | {"stream": True, "stream_options": {"include_usage": True}}
        )
        after = client.post("/v1/completions", json=payload | {"n": 0})
    usage = plain.json()["usage"]
    used, budget = usage["total_tokens"], usage["prompt_tokens"] + 30
    assert used < budget
    assert parse_sse(streamed.text)[-2]["usage"]["total_tokens"] == used
    assert rate_headers(plain.headers)["remaining-tokens"] == str(1000 - used)
    assert rate_headers(streamed.headers)["remaining-tokens"] == str(1000 - used - budget)
    assert rate_headers(after.headers)["remaining-tokens"] == str(1000 - 2 * used)
