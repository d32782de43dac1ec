"""The rate limiter alone, on a clock the test moves: continuous refill, key and user buckets, refunds, the headers'
values, bounded memory; and the per-user usage rows /metrics reads."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.rate_limit_helpers import KEY, FakeClock, limiter, refused
from tokenmill.api.errors import APIError
from tokenmill.api.rate_limit import (
    OTHER,
    REQUESTS,
    TOKENS,
    Limit,
    LocalLimits,
    Quota,
    RateLimiter,
    UserUsage,
    duration,
)
from tokenmill.api.record import pseudonym
from tokenmill.config import Config, parse_rate


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.02, "20ms"),
        (0.0201, "21ms"),  # rounded up: a client that waits this long finds the capacity back
        (0.9999, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (20.0, "20s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (61.25, "1m1.25s"),
        (3600.0, "1h0m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_durations_are_written_as_openai_writes_its_reset_headers(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_bucket_refills_continuously_and_retry_after_is_when_a_request_fits_again() -> None:
    clock = FakeClock()
    rates = limiter(clock, requests="3/min")
    for _ in range(3):
        rates.acquire(KEY, None, 0)
    error = refused(rates.acquire, KEY, None, 0)
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers == {"Retry-After": "20"}  # one request of three per minute comes back every 20 s
    assert "Please try again in 20s" in error.message
    clock.advance(19.5)
    assert refused(rates.acquire, KEY, None, 0).headers == {"Retry-After": "1"}
    clock.advance(0.5)
    rates.acquire(KEY, None, 0)
    assert refused(rates.acquire, KEY, None, 0).headers == {"Retry-After": "20"}


def test_headers_count_down_exactly_and_reset_is_the_time_to_full() -> None:
    clock = FakeClock()
    rates = limiter(clock, requests="3/min", tokens="1000/h")
    assert rates.headers(KEY, None) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "0s",
    }
    rates.acquire(KEY, None, 100)
    rates.acquire(KEY, None, 150)
    headers = rates.headers(KEY, None)
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-reset-requests"] == "40s"
    assert headers["x-ratelimit-remaining-tokens"] == "750"
    assert headers["x-ratelimit-reset-tokens"] == "15m0s"  # 250 of 1000 an hour
    clock.advance(3.6)  # one token back (1000 an hour) and 0.18 of a request
    headers = rates.headers(KEY, None)
    assert (headers["x-ratelimit-remaining-tokens"], headers["x-ratelimit-reset-tokens"]) == ("751", "14m56.4s")
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-reset-requests"]) == ("1", "36.4s")


def test_a_user_has_its_own_bucket_and_the_key_binds_its_users_together() -> None:
    rates = limiter(FakeClock(), requests="3/min", user_requests="2/min")
    rates.acquire(KEY, "alice", 0)
    rates.acquire(KEY, "alice", 0)
    error = refused(rates.acquire, KEY, "alice", 0)
    assert error.type == "requests" and "this `user`" in error.message
    rates.acquire(KEY, "bob", 0)  # bob's own bucket is full; the key has one left
    error = refused(rates.acquire, KEY, "bob", 0)
    assert "this API key" in error.message
    error = refused(rates.acquire, KEY, None, 0)  # no user: only the key's bucket, which is empty
    assert "this API key" in error.message


def test_the_headers_show_the_tighter_of_the_key_and_the_user() -> None:
    rates = limiter(FakeClock(), requests="10/min", user_requests="3/min")
    rates.acquire(KEY, "alice", 0)
    assert rates.headers(KEY, "alice")["x-ratelimit-remaining-requests"] == "2"  # alice's bucket: 2 of 3 left
    assert rates.headers(KEY, "alice")["x-ratelimit-limit-requests"] == "3"
    for i in range(8):
        rates.acquire(KEY, f"user-{i}", 0)
    assert rates.headers(KEY, "alice")["x-ratelimit-remaining-requests"] == "1"  # the key's: 1 of 10 left
    assert rates.headers(KEY, "alice")["x-ratelimit-limit-requests"] == "10"
    assert rates.headers(KEY, None)["x-ratelimit-remaining-requests"] == "1"


def test_a_refused_request_charges_no_bucket() -> None:
    rates = limiter(FakeClock(), tokens="100/min", user_requests="2/min")
    rates.acquire(KEY, "alice", 80)
    error = refused(rates.acquire, KEY, "alice", 30)  # alice's request bucket had room, the key's tokens did not
    assert error.type == "tokens"
    assert rates.headers(KEY, "alice")["x-ratelimit-remaining-requests"] == "1"
    rates.acquire(KEY, "alice", 20)
    assert rates.headers(KEY, "alice")["x-ratelimit-remaining-tokens"] == "0"


def test_keys_are_limited_apart() -> None:
    rates = limiter(FakeClock(), requests="1/min")
    rates.acquire(pseudonym("key-a"), None, 0)
    refused(rates.acquire, pseudonym("key-a"), None, 0)
    rates.acquire(pseudonym("key-b"), None, 0)


def test_a_request_larger_than_the_limit_is_refused_without_a_retry_after() -> None:
    rates = limiter(FakeClock(), tokens="100/min", user_tokens="50/min")
    error = refused(rates.acquire, KEY, None, 101)
    assert (error.status, error.type, error.code, error.headers) == (429, "tokens", "rate_limit_exceeded", None)
    assert error.message.startswith("Request too large for this API key on tokens per min: Limit 100, Requested 101")
    assert "Request too large for this `user`" in refused(rates.acquire, KEY, "alice", 51).message
    rates.acquire(KEY, "alice", 50)  # as large as the limit: it fits a full bucket


def test_a_quota_refunds_the_unused_tokens_once_and_a_cancelled_request_entirely() -> None:
    clock = FakeClock()
    rates = limiter(clock, requests="5/min", tokens="1000/min")

    async def run() -> None:
        quota = Quota(LocalLimits(rates), KEY)
        await quota.acquire(300)
        await quota.finish(120)
        await quota.finish(0)  # settled already: no second refund
        assert (await quota.headers())["x-ratelimit-remaining-tokens"] == "880"
        cancelled = Quota(LocalLimits(rates), KEY)
        await cancelled.acquire(400)
        await cancelled.cancel()

    asyncio.run(run())
    assert rates.headers(KEY, None)["x-ratelimit-remaining-tokens"] == "880"
    assert rates.headers(KEY, None)["x-ratelimit-remaining-requests"] == "4"


def test_a_quota_keeps_the_headers_of_its_last_answer_and_a_refusal_carries_them() -> None:
    clock = FakeClock()
    rates = limiter(clock, requests="2/min")

    async def run() -> tuple[dict[str, str], APIError]:
        first = Quota(LocalLimits(rates), KEY)
        await first.acquire(0)
        seen = await first.headers()
        await Quota(LocalLimits(rates), KEY).acquire(0)
        with pytest.raises(APIError) as caught:
            await Quota(LocalLimits(rates), KEY).check()
        return seen, caught.value

    seen, refusal = asyncio.run(run())
    assert seen["x-ratelimit-remaining-requests"] == "1"
    assert refusal.headers is not None and refusal.headers["x-ratelimit-remaining-requests"] == "0"
    assert refusal.headers["Retry-After"] == "30"


def test_a_refund_never_fills_a_bucket_past_its_capacity() -> None:
    clock = FakeClock()
    rates = limiter(clock, tokens="1000/min")
    rates.acquire(KEY, None, 600)
    clock.advance(30)  # 500 back: 900
    rates.refund(KEY, None, 0, 600)
    assert rates.headers(KEY, None)["x-ratelimit-remaining-tokens"] == "1000"


def test_quota_without_limits_does_nothing() -> None:
    async def run() -> dict[str, str]:
        quota = Quota(None, KEY)
        await quota.check()
        await quota.acquire(10**9)
        await quota.finish(0)
        return await quota.headers()

    assert asyncio.run(run()) == {}


def test_full_buckets_are_dropped_so_memory_follows_the_active_users() -> None:
    clock = FakeClock()
    rates = limiter(clock, requests="1000/min", user_requests="10/min")
    for i in range(200):
        rates.acquire(KEY, f"user-{i}", 0)
    assert rates.bucket_count == 201  # the key's and one per user
    clock.advance(6)  # every user's bucket is full again (10 a minute); the key's is not (200 of 1000 used)
    rates.acquire(KEY, "late", 0)
    assert rates.bucket_count == 2  # the key's and late's
    clock.advance(60)
    rates.headers(KEY, None)
    assert rates.bucket_count == 0


def test_looking_at_the_headers_keeps_no_bucket() -> None:
    rates = limiter(FakeClock(), requests="10/min", user_requests="5/min")
    rates.headers(KEY, "alice")
    rates.check(KEY, "alice")
    assert rates.bucket_count == 0


def test_user_limits_bind_only_requests_that_name_a_user() -> None:
    rates = limiter(FakeClock(), user_requests="1/min")
    assert rates.headers(KEY, None) == {}
    for _ in range(3):
        rates.acquire(KEY, None, 0)
    rates.acquire(KEY, "alice", 0)
    refused(rates.acquire, KEY, "alice", 0)
    assert set(rates.headers(KEY, "alice")) == {f"x-ratelimit-{w}-requests" for w in ("limit", "remaining", "reset")}


def test_from_config_reads_the_four_settings() -> None:
    assert RateLimiter.from_config(Config()) is None
    rates = RateLimiter.from_config(
        Config(rate_limit_requests="5/s", rate_limit_user_tokens="100/h"),
    )
    assert rates is not None
    assert rates.limits == (Limit(REQUESTS, parse_rate("5/s"), False), Limit(TOKENS, parse_rate("100/h"), True))


def test_keys_and_users_are_known_only_by_a_hash() -> None:
    rates = limiter(FakeClock(), requests="10/min", user_requests="5/min")
    rates.acquire(pseudonym("sk-secret"), "alice@example.com", 0)
    held = repr(rates._buckets)
    assert "sk-secret" not in held and "alice" not in held
    assert pseudonym("sk-secret") in held and pseudonym("alice@example.com") in held


# --- usage per user -------------------------------------------------------------------------------------------------
def test_usage_rows_are_the_top_users_by_requests_and_the_rest_as_other() -> None:
    usage = UserUsage(top_k=2)
    for user, requests in [("a", 1), ("b", 3), ("c", 2), ("d", 1)]:
        for _ in range(requests):
            usage.record(user, 10)
    rows = usage.rows()
    assert [(r.user, r.requests, r.tokens) for r in rows] == [
        (pseudonym("b"), 3, 30),
        (pseudonym("c"), 2, 20),
        (OTHER, 2, 20),
    ]


def test_usage_rows_always_end_with_other_even_when_empty() -> None:
    assert [(r.user, r.requests, r.tokens) for r in UserUsage().rows()] == [(OTHER, 0, 0)]


def test_usage_memory_and_rows_are_bounded_and_nothing_is_lost() -> None:
    usage = UserUsage(top_k=3, max_tracked=8)
    for i in range(100):
        for _ in range(1 + i % 7):
            usage.record(f"user-{i}", 5)
        assert usage.tracked <= 8
    rows = usage.rows()
    assert len(rows) == 4 and rows[-1].user == OTHER
    total_requests = sum(1 + i % 7 for i in range(100))
    assert sum(r.requests for r in rows) == total_requests
    assert sum(r.tokens for r in rows) == 5 * total_requests
    assert all(r.requests == 7 for r in rows[:3])  # the busiest survive the folding
