"""The load generator against a fake OpenAI server (an httpx transport): bodies, token counts, bounds, failures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.bench.fake_openai import EARLY_STOP_AT, EOS_ID, FakeOpenAI
from tokenmill.bench.load import LoadSettings, bench_url, make_client, run_level, stream_completion
from tokenmill.bench.loopback import NotLoopbackError

URL = "http://127.0.0.1:9"  # never dialled: the fake transport answers


def run_pass(fake: FakeOpenAI, settings: LoadSettings) -> dict[str, Any]:
    return asyncio.run(asyncio.wait_for(bench_url(URL, settings, fake.transport()), timeout=30))


def test_a_pass_bans_eos_from_tokenizer_info_and_counts_usage() -> None:
    fake = FakeOpenAI()
    result = run_pass(fake, LoadSettings(max_tokens=6, single_runs=2, concurrency=(1, 3), requests=5))
    assert result["model"] == "fake-model" and result["eos_ids"] == [EOS_ID]
    assert len(fake.bodies) == 1 + 2 + 5 + 5  # warm-up, single-stream runs, two levels
    body = fake.bodies[-1]
    assert body["logit_bias"] == {str(EOS_ID): -100} and body["temperature"] == 0 and body["stream"] is True
    assert body["model"] == "fake-model" and body["max_tokens"] == 6
    single, levels = result["single"], result["levels"]
    assert single["completion_tokens"] == [6, 6] and single["decode_tok_s"] > 0 and single["ttft_s"] > 0
    assert [level["concurrency"] for level in levels] == [1, 3]
    for level in levels:
        assert level["requests"] == 5 and level["failed"] == 0 and level["early_stops"] == 0
        assert level["completion_tokens"] == 30 and level["tokens_exact"] is True
        assert level["agg_tok_s"] > 0 and level["latency_p99_s"] >= level["latency_p50_s"] > 0


def test_concurrent_clients_overlap_up_to_the_level() -> None:
    fake = FakeOpenAI(step_s=0.005)
    result = run_pass(fake, LoadSettings(max_tokens=5, single_runs=1, concurrency=(4,), requests=8))
    assert fake.max_in_flight == 4
    assert result["levels"][0]["requests"] == 8


def test_a_peer_without_usage_or_tokenizer_info_is_counted_from_finish_reasons() -> None:
    fake = FakeOpenAI(peer_like=True)
    settings = LoadSettings(max_tokens=6, single_runs=1, concurrency=(2,), requests=2, eos_ids=(EOS_ID,))
    result = run_pass(fake, settings)
    assert result["levels"][0]["completion_tokens"] == 12 and result["levels"][0]["tokens_exact"] is True


def test_eos_that_is_not_banned_stops_early_and_is_counted_for_real() -> None:
    fake = FakeOpenAI(peer_like=True)  # no /tokenizer_info: nothing banned without --eos-ids
    result = run_pass(fake, LoadSettings(max_tokens=6, single_runs=1, concurrency=(2,), requests=2))
    level = result["levels"][0]
    assert "logit_bias" in fake.bodies[0] and fake.bodies[0]["logit_bias"] == {}
    assert level["early_stops"] == 2 and level["completion_tokens"] == 2 * EARLY_STOP_AT
    assert level["tokens_exact"] is False  # counted from chunks: no usage and no "length" finish


def test_failed_requests_are_reported_not_raised() -> None:
    fake = FakeOpenAI(fail_every=2)
    result = run_pass(fake, LoadSettings(max_tokens=3, single_runs=1, concurrency=(1,), requests=4))
    level = result["levels"][0]
    assert level["failed"] == 2 and level["requests"] == 4 and level["completion_tokens"] == 6


def test_a_level_stops_starting_requests_after_its_deadline() -> None:
    fake = FakeOpenAI()
    settings = LoadSettings(max_tokens=2, concurrency=(3,), requests=1000, level_timeout_s=0.0)

    async def level() -> dict[str, Any]:
        async with make_client(settings, fake.transport()) as client:
            return await run_level(client, URL, "fake-model", settings, (EOS_ID,), 3)

    assert asyncio.run(level())["requests"] == 0 and fake.bodies == []


def test_a_request_past_its_total_timeout_fails() -> None:
    fake = FakeOpenAI(step_s=0.05)

    async def one() -> Any:
        async with make_client(LoadSettings(), fake.transport()) as client:
            body = {"model": "m", "prompt": "p", "max_tokens": 100, "stream": True, "logit_bias": {str(EOS_ID): -100}}
            return await stream_completion(client, URL, body, timeout_s=0.1)

    result = asyncio.run(one())
    assert not result.ok and "within" in (result.error or "")


def test_requests_per_level_default_to_twice_the_concurrency() -> None:
    assert LoadSettings().requests_for(1) == 4
    assert LoadSettings().requests_for(16) == 32
    assert LoadSettings(requests=3).requests_for(16) == 3


def test_non_loopback_urls_are_refused_before_any_request() -> None:
    fake = FakeOpenAI()
    with pytest.raises(NotLoopbackError):
        asyncio.run(bench_url("http://192.0.2.1:8000", LoadSettings(), fake.transport()))
    assert fake.bodies == []


def test_the_client_ignores_proxy_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://192.0.2.1:3128")
    client = make_client(LoadSettings())
    assert client._trust_env is False
    asyncio.run(client.aclose())
    assert isinstance(client, httpx.AsyncClient)
