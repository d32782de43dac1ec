"""Bounded admission: past the waiting caps new requests get 429 at once; draining and a dead engine give 503."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.api.api_helpers import body, hold_then_probe, post, run
from tests.api.fake_engine import FakeEngine
from tokenmill.api.admission import Admission
from tokenmill.api.app import create_app
from tokenmill.config import Config


def test_a_ticket_leaves_the_waiting_count_as_its_prompts_start_and_everything_on_close() -> None:
    admission = Admission(max_waiting_requests=3, max_waiting_tokens=100)
    ticket = admission.admit([10, 20])
    assert (admission.waiting_requests, admission.waiting_tokens, admission.in_flight) == (2, 30, 1)
    ticket.started(1)
    ticket.started(1)  # idempotent
    assert (admission.waiting_requests, admission.waiting_tokens) == (1, 10)
    ticket.close()
    ticket.close()
    assert (admission.waiting_requests, admission.waiting_tokens, admission.in_flight) == (0, 0, 0)


@pytest.mark.parametrize(
    ("waiting", "incoming", "limit_type"),
    [([[1]] * 3, [1], "requests"), ([[1, 2]], [1, 1], "requests"), ([[60]], [50], "tokens")],
)
def test_past_a_cap_admit_raises_429_naming_the_limit(
    waiting: list[list[int]], incoming: list[int], limit_type: str
) -> None:
    admission = Admission(max_waiting_requests=3, max_waiting_tokens=100)
    for lengths in waiting:
        admission.admit(lengths)
    with pytest.raises(Exception) as caught:
        admission.admit(incoming)
    error: Any = caught.value
    assert (error.status, error.type, error.code) == (429, limit_type, "rate_limit_exceeded")
    assert error.headers == {"Retry-After": "1"}


def test_an_empty_queue_admits_a_request_larger_than_the_caps() -> None:
    admission = Admission(max_waiting_requests=2, max_waiting_tokens=10)
    admission.admit([500, 500, 500])
    assert admission.waiting_requests == 3


def test_over_the_cap_a_new_request_gets_429_and_admitted_ones_are_untouched() -> None:
    engine = FakeEngine(hang_at_step=0)  # never produces a first output: every admitted prompt stays waiting
    app = create_app(engine, Config(max_waiting_requests=2))
    response, held = run(lambda: hold_then_probe(app, 2, body()))
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(engine.requests) == 2  # the refused request never reached the engine
    assert all(isinstance(r, asyncio.CancelledError) for r in held)
    admission = app.state.admission
    assert (admission.waiting_requests, admission.waiting_tokens, admission.in_flight) == (0, 0, 0)


def test_the_token_cap_refuses_a_large_prompt_while_others_wait() -> None:
    app = create_app(FakeEngine(hang_at_step=0), Config(max_waiting_tokens=100))
    response, _ = run(lambda: hold_then_probe(app, 1, body(prompt="x" * 100)))
    assert response.status_code == 429 and response.json()["error"]["type"] == "tokens"


def test_once_started_a_request_no_longer_counts_as_waiting() -> None:
    app = create_app(FakeEngine(), Config(max_waiting_requests=1))
    for _ in range(3):
        assert run(lambda: post(app, "/v1/completions", body(stream=True))).status_code == 200
    assert app.state.admission.waiting_requests == 0 and app.state.admission.in_flight == 0


def test_while_draining_completions_and_health_get_503_with_retry_after() -> None:
    app = create_app(FakeEngine(), Config())
    app.state.admission.begin_drain()
    completion = run(lambda: post(app, "/v1/completions", body()))
    health = run(lambda: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t").get("/health"))
    for response in (completion, health):
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "service_unavailable"


def test_a_dead_engine_refuses_completions_with_503() -> None:
    app = create_app(FakeEngine(healthy=False), Config())
    response = run(lambda: post(app, "/v1/completions", body()))
    assert response.status_code == 503 and "engine" in response.json()["error"]["message"]


def test_wait_idle_returns_when_the_last_ticket_closes() -> None:
    async def scenario() -> tuple[bool, bool]:
        admission = Admission(10, 100)
        ticket = admission.admit([1])
        timed_out = await admission.wait_idle(0.01)
        asyncio.get_running_loop().call_later(0.01, ticket.close)
        return timed_out, await admission.wait_idle(5)

    assert run(scenario) == (False, True)
