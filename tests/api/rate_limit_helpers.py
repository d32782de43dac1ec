"""Helpers the rate-limit tests share: a clock the test moves by hand, an app whose limiter reads it, and the
x-ratelimit-* headers of a response."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
from fastapi import FastAPI

from tests.api.fake_engine import FakeEngine
from tokenmill.api.app import create_app
from tokenmill.api.engine_protocol import Engine
from tokenmill.api.errors import APIError
from tokenmill.api.rate_limit import REQUESTS, TOKENS, Limit, LocalLimits, RateLimiter
from tokenmill.api.record import pseudonym
from tokenmill.config import Config, parse_rate

KEY = pseudonym("sk-test")

RATE_HEADERS = tuple(
    f"x-ratelimit-{what}-{dimension}"
    for dimension in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)


@dataclass
class FakeClock:
    now: float = 1000.0  # not 0, so nothing can pass for "never set"

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(clock: FakeClock, **rates: str) -> RateLimiter:
    """A limiter on `clock`; rates: requests=, tokens= (per key), user_requests=, user_tokens= (per user), "N/min"."""
    limits = [
        Limit(TOKENS if name.endswith("tokens") else REQUESTS, parse_rate(text), name.startswith("user_"))
        for name, text in rates.items()
    ]
    return RateLimiter(limits, clock)


def refused(call: Callable[..., object], *args: object) -> APIError:
    """The APIError `call(*args)` raises."""
    with pytest.raises(APIError) as caught:
        call(*args)
    return caught.value


def limited_app(config: Config, clock: FakeClock, engine: Engine | None = None) -> FastAPI:
    """create_app(engine, config) with its rate limiter on `clock`."""
    app = create_app(engine if engine is not None else FakeEngine(), config)
    rates = RateLimiter.from_config(config, clock)
    app.state.rate_limits = LocalLimits(rates) if rates is not None else None
    return app


def rate_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The x-ratelimit-* headers among `headers`, by their short name: "remaining-requests" → "2"."""
    return {name.removeprefix("x-ratelimit-"): headers[name] for name in RATE_HEADERS if name in headers}
