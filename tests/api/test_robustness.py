"""The app around the real AsyncEngine under faults, cancellations and timeouts: nothing hangs, nothing leaks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from tests.api.api_helpers import TINY_MODEL as MODEL
from tests.api.api_helpers import call_then_disconnect, parse_sse, post, run, tiny_engine
from tests.engine.tiny import ByteTokenizer, poison_hidden, tiny_core
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.sampling import SamplingParams

T = TypeVar("T")
NO_EOS = {"1": -100}  # ByteTokenizer.eos_id: these requests end only by max_tokens, a cancel or a fault
TOK = ByteTokenizer()


def with_engine(scenario: Callable[[AsyncEngine, FastAPI], Awaitable[T]], config: Config | None = None) -> T:
    """Start a tiny real engine, run `scenario(engine, app)` under a time bound, stop the engine."""

    async def go() -> T:
        engine = tiny_engine()
        await engine.start()
        try:
            return await scenario(engine, create_app(engine, config or Config()))
        finally:
            await engine.stop()

    return run(go, timeout=60)


async def settled(engine: AsyncEngine) -> dict[str, int]:
    """Engine counters once nothing runs (bounded wait); the test then asserts on them."""
    for _ in range(1000):
        stats = engine.stats()
        if not (stats.num_running or stats.num_waiting or stats.num_used_blocks):
            break
        await asyncio.sleep(0.01)
    stats = engine.stats()
    return {"running": stats.num_running, "waiting": stats.num_waiting, "used_blocks": stats.num_used_blocks}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "temperature": 0, **fields}


def test_nan_in_one_request_fails_it_alone() -> None:
    async def scenario(engine: AsyncEngine, app: FastAPI) -> tuple[list[httpx.Response], dict[str, int]]:
        poison_hidden(engine.core, lambda seq: "poison" in TOK.decode(seq.token_ids[: seq.num_prompt_tokens]))
        responses = await asyncio.gather(
            post(app, "/v1/completions", completion(prompt="fine", logit_bias=NO_EOS)),
            post(app, "/v1/completions", completion(prompt="poison")),
            post(app, "/v1/completions", completion(prompt="poison", stream=True)),
            post(app, "/v1/completions", completion(prompt=["fine", "poison"], n=2)),
        )
        after = await post(app, "/v1/completions", completion(prompt="fine again"))
        return [*responses, after], await settled(engine)

    (good, bad, bad_stream, mixed, after), stats = with_engine(scenario)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    for response in (bad, mixed):
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "non-finite" in error["message"]
    events = parse_sse(bad_stream.text)
    assert bad_stream.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert after.status_code == 200
    assert stats == {"running": 0, "waiting": 0, "used_blocks": 0}


def test_a_dead_engine_loop_answers_503_instead_of_hanging() -> None:
    async def scenario(engine: AsyncEngine, app: FastAPI) -> list[httpx.Response]:
        def broken_step() -> list[Any]:
            raise RuntimeError("injected engine-loop fault")

        engine._step = broken_step  # type: ignore[method-assign]
        in_flight = await post(app, "/v1/completions", completion(prompt="hi"))
        stream = await post(app, "/v1/completions", completion(prompt="hi", stream=True))
        health = await httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t").get("/health")
        return [in_flight, stream, health]

    in_flight, stream, health = with_engine(scenario)
    assert in_flight.status_code == 503 and in_flight.json()["error"]["code"] == "service_unavailable"
    assert stream.status_code == 503 and stream.headers["retry-after"] == "1"  # refused before it streamed
    assert health.status_code == 503


def test_an_abort_takes_effect_at_the_very_next_step() -> None:
    engine = tiny_engine()
    params = SamplingParams(max_tokens=50, temperature=0.0)
    engine._adds.append(("r", TOK.encode("a request"), params))
    engine._step()
    assert engine.stats().num_running == 1 and engine.stats().num_used_blocks > 0
    asyncio.run(engine.abort("r"))
    engine._step()
    stats = engine.stats()
    assert "r" not in engine.core.requests and stats.num_running == 0 and stats.num_used_blocks == 0


def test_two_hundred_random_cancellations_leave_no_blocks_and_no_sequences() -> None:
    rng = random.Random(5)

    def cancelled_request() -> tuple[dict[str, Any], Callable[[list[dict[str, Any]]], bool]]:
        payload = completion(
            prompt=rng.choice(["Hello", "The quick brown fox", ["a", "bc"]]),
            max_tokens=rng.randint(1, 200),
            n=rng.choice([1, 1, 2, 3]),
            stream=rng.random() < 0.6,
            echo=rng.random() < 0.2,
            logprobs=rng.choice([None, 2]),
            logit_bias=NO_EOS,
        )
        after_chunks, after_s = rng.randint(0, 6), rng.uniform(0.0, 0.05)
        loop_time = asyncio.get_running_loop().time
        deadline = loop_time() + after_s

        def disconnect_when(sent: list[dict[str, Any]]) -> bool:
            bodies = sum(1 for m in sent if m["type"] == "http.response.body")
            return bodies >= after_chunks if payload["stream"] else loop_time() >= deadline

        return payload, disconnect_when

    async def scenario(engine: AsyncEngine, app: FastAPI) -> dict[str, int]:
        for _ in range(10):
            batch = [cancelled_request() for _ in range(20)]
            await asyncio.gather(*(call_then_disconnect(app, p, when) for p, when in batch))
        return await settled(engine)

    assert with_engine(scenario) == {"running": 0, "waiting": 0, "used_blocks": 0}


def test_request_timeout_ends_the_request_and_frees_its_blocks() -> None:
    config = Config(request_timeout_s=0.05)

    async def scenario(engine: AsyncEngine, app: FastAPI) -> tuple[httpx.Response, httpx.Response, dict[str, int]]:
        long = completion(prompt="slow", max_tokens=240, n=4, logit_bias=NO_EOS, temperature=1.0)
        plain = await post(app, "/v1/completions", long)
        streamed = await post(app, "/v1/completions", long | {"stream": True})
        return plain, streamed, await settled(engine)

    plain, streamed, stats = with_engine(scenario, config)
    assert plain.status_code == 504
    error = plain.json()["error"]
    assert error["code"] == "request_timeout" and "0.05 s" in error["message"]
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert stats == {"running": 0, "waiting": 0, "used_blocks": 0}


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_up_front() -> None:
    engine = AsyncEngine(tiny_core(num_kv_blocks=8), MODEL, "fp_tiny")  # 8 blocks × 4 slots: 32 tokens in all
    assert engine.max_model_len == 32

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        await engine.start()
        try:
            app = create_app(engine, Config())
            too_big = await post(app, "/v1/completions", completion(prompt="0123456789", max_tokens=30))
            fits = await post(app, "/v1/completions", completion(prompt="0123", max_tokens=20, n=3, logit_bias=NO_EOS))
            return too_big, fits
        finally:
            await engine.stop()

    too_big, fits = run(scenario)
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "context_length_exceeded"
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 60  # 3 × 20, via preemption
    assert engine.stats().num_preemptions > 0 and engine.stats().num_used_blocks == 0


def test_a_request_reaches_the_engine_when_generate_is_called_not_when_it_is_read() -> None:
    """A burst's requests are queued as each is admitted: the engine runs one before anybody reads its outputs."""

    async def scenario(engine: AsyncEngine, app: FastAPI) -> list[int]:
        outputs = engine.generate("r", TOK.encode("a request"), SamplingParams(max_tokens=4, temperature=0.0))
        for _ in range(1000):  # bounded wait for the engine to have run it, unread
            if engine.stats().steps > 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().steps > 0
        return [t for out in [o async for o in outputs] for d in out.deltas for t in d.token_ids]

    assert len(with_engine(scenario)) == 4


def test_outputs_closed_or_dropped_before_they_are_read_abort_the_request() -> None:
    engine = tiny_engine()  # stepped by hand
    params = SamplingParams(max_tokens=400, temperature=0.0, logit_bias={1: -100.0})
    closed = engine.generate("closed", TOK.encode("a request"), params)
    engine._step()
    assert "closed" in engine.core.requests
    closed.close()
    engine.generate("dropped", TOK.encode("another"), params)  # never kept: collected at once
    engine._step()
    stats = engine.stats()
    assert not engine.core.requests and stats.num_running == 0 and stats.num_used_blocks == 0
    assert not engine._queues


def test_a_stream_left_before_its_response_started_frees_its_request() -> None:
    """The engine has the request from admission on: a client gone before the stream's first byte still frees it
    within a few steps (left running, each would take its 400 tokens)."""

    async def scenario(engine: AsyncEngine, app: FastAPI) -> tuple[dict[str, int], int]:
        payload = completion(prompt="Hello", max_tokens=400, stream=True, logit_bias=NO_EOS)
        await asyncio.gather(*(call_then_disconnect(app, payload, lambda sent: True) for _ in range(5)))
        return await settled(engine), engine.stats().steps

    counts, steps = with_engine(scenario)
    assert counts == {"running": 0, "waiting": 0, "used_blocks": 0} and steps < 100
