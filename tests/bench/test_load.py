"""The load generator against a fake OpenAI server on loopback: bodies, token counts, bounds, failures."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.bench.fake_openai import EARLY_STOP_AT, EOS_ID, FakeOpenAI
from tokenmill.bench import load
from tokenmill.bench.load import LoadSettings, bench_url, make_client, run_level, stream_completion
from tokenmill.bench.load import run as load_run
from tokenmill.bench.loopback import NotLoopbackError


def run_pass(fake: FakeOpenAI, settings: LoadSettings) -> dict[str, Any]:
    with fake.running() as url:
        return asyncio.run(asyncio.wait_for(bench_url(url, settings), timeout=30))


def test_a_pass_bans_eos_from_tokenizer_info_and_counts_usage() -> None:
    fake = FakeOpenAI()
    result = run_pass(fake, LoadSettings(max_tokens=6, single_runs=2, concurrency=(1, 3), requests=5))
    assert result["model"] == "fake-model" and result["eos_ids"] == [EOS_ID]
    assert (
        len(fake.bodies) == 1 + 2 + 1 + 2 + 5 + 5
    )  # warm-up, single-stream runs, a probe and two prefills, two levels
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


def test_a_server_that_closes_its_connection_after_each_stream_answers_every_request() -> None:
    fake = FakeOpenAI(close_after_stream=True)  # llama-server's way, in spite of its Keep-Alive header
    result = run_pass(fake, LoadSettings(max_tokens=3, single_runs=3, concurrency=(1, 2), requests=4))
    assert result["single"]["failed"] == 0 and [level["failed"] for level in result["levels"]] == [0, 0]
    assert len(fake.bodies) == 1 + 3 + 1 + 2 + 4 + 4


def test_each_prefill_is_one_fresh_prompt_of_about_its_length() -> None:
    fake = FakeOpenAI()
    settings = LoadSettings(max_tokens=3, single_runs=1, concurrency=(1,), requests=1, prefill_tokens=(40, 400))
    first, second = run_pass(fake, settings), run_pass(fake, settings)
    prompts = [b["prompt"] for b in fake.bodies if not b.get("stream") and b["prompt"] != load.PASSAGE]
    assert len(prompts) == 4 and len(set(prompts)) == 4  # no round's prompt is a prefix another could reuse
    assert len({p.split("\n")[0] for p in prompts}) == 4
    for result in (first, second):
        short, long = result["prefill"]
        assert [short["length"], long["length"]] == [40, 400] and not short["error"] and not long["error"]
        assert 0.8 * 40 <= short["prompt_tokens"] <= 1.2 * 40 and 0.9 * 400 <= long["prompt_tokens"] <= 1.1 * 400
        assert long["tok_s"] == long["prompt_tokens"] / long["seconds"] > 0


def test_a_prompt_past_the_servers_context_is_a_failed_prefill_not_a_failed_pass() -> None:
    fake = FakeOpenAI(context=len(load.PASSAGE.split()) + 10)  # the passage, not 400 words
    settings = LoadSettings(max_tokens=3, single_runs=1, concurrency=(1,), requests=1, prefill_tokens=(40, 400))
    result = run_pass(fake, settings)
    short, long = result["prefill"]
    assert short["tok_s"] > 0 and long["tok_s"] is None and "HTTP 400" in long["error"]
    assert result["levels"][0]["failed"] == 0


def test_a_prompt_the_server_cut_short_gets_no_figure() -> None:
    fake = FakeOpenAI(cut_to=len(load.PASSAGE.split()) + 10)
    settings = LoadSettings(max_tokens=3, single_runs=1, concurrency=(1,), requests=1, prefill_tokens=(40, 400))
    short, long = run_pass(fake, settings)["prefill"]
    assert short["tok_s"] > 0 and long["tok_s"] is None
    assert (
        long["error"] == f"the server cut the prompt to {long['prompt_tokens']} tokens" and long["prompt_tokens"] < 360
    )


def test_failed_requests_are_reported_not_raised() -> None:
    fake = FakeOpenAI(fail_every=2)
    result = run_pass(fake, LoadSettings(max_tokens=3, single_runs=1, concurrency=(1,), requests=4))
    level = result["levels"][0]
    assert level["failed"] == 2 and level["requests"] == 4 and level["completion_tokens"] == 6


def test_a_level_stops_starting_requests_after_its_deadline() -> None:
    fake = FakeOpenAI()
    settings = LoadSettings(max_tokens=2, concurrency=(3,), requests=1000, level_timeout_s=0.0)

    async def level(url: str) -> dict[str, Any]:
        async with make_client(settings) as client:
            return await run_level(client, url, "fake-model", settings, (EOS_ID,), 3)

    with fake.running() as url:
        assert asyncio.run(level(url))["requests"] == 0 and fake.bodies == []


def test_a_request_past_its_total_timeout_fails() -> None:
    fake = FakeOpenAI(step_s=0.05)

    async def one(url: str) -> Any:
        async with make_client(LoadSettings()) as client:
            body = {"model": "m", "prompt": "p", "max_tokens": 100, "stream": True, "logit_bias": {str(EOS_ID): -100}}
            return await stream_completion(client, url, body, timeout_s=0.1)

    with fake.running() as url:
        result = asyncio.run(one(url))
    assert not result.ok and "within" in (result.error or "")


def test_requests_per_level_default_to_twice_the_concurrency() -> None:
    assert LoadSettings().requests_for(1) == 4
    assert LoadSettings().requests_for(16) == 32
    assert LoadSettings(requests=3).requests_for(16) == 3


def test_non_loopback_urls_are_refused_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_client(settings: LoadSettings) -> None:
        raise AssertionError("a client was made for a URL that is not loopback")

    monkeypatch.setattr("tokenmill.bench.load.make_client", no_client)
    with pytest.raises(NotLoopbackError):
        asyncio.run(bench_url("http://192.0.2.1:8000", LoadSettings()))


def test_the_client_ignores_proxy_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://192.0.2.1:3128")
    fake = FakeOpenAI()

    async def one(url: str) -> Any:
        async with make_client(LoadSettings()) as client:
            assert isinstance(client, aiohttp.ClientSession) and client.trust_env is False
            body = {"model": "m", "prompt": "p", "max_tokens": 2, "stream": True, "logit_bias": {str(EOS_ID): -100}}
            return await stream_completion(client, url, body, timeout_s=10)

    with fake.running() as url:
        assert asyncio.run(one(url)).completion_tokens == 2  # through no proxy: the one named does not exist


def test_the_load_generator_runs_on_uvloop_where_it_is_installed() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert load_run(loop_module()).startswith("uvloop")


@pytest.mark.parametrize(
    ("finish", "tokens", "exact", "expected"),
    [
        ("stop", 6, True, "length"),  # usage counts all of max_tokens: it ran to the end, whatever the label
        ("stop", 3, True, "stop"),  # a real early stop
        ("stop", 6, False, "stop"),  # counted from chunks: nothing proves it ran to the end
        ("length", 6, True, "length"),
        (None, 0, False, None),
    ],
)
def test_a_stop_that_ran_to_max_tokens_is_a_length_finish(
    finish: str | None, tokens: int, exact: bool, expected: str | None
) -> None:
    assert load._finish(finish, tokens, exact, max_tokens=6) == expected
