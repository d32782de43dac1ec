"""GET /metrics after real requests: each counter moves by exactly what was sent, each timing is observed once per
prompt (streamed or not), refusals, aborts and failures are counted with their reasons, the engine's series agree with
its /stats, each model has its own series, and the scrape needs the key unless --metrics-public."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import (
    TINY_MODEL,
    body,
    call_then_disconnect,
    get,
    hold_then_probe,
    parse_sse,
    post,
    run,
    tiny_engine,
)
from tests.api.fake_engine import FakeEngine
from tests.api.scrape import Samples, parse, scrape, value
from tests.engine.tiny import drafting_core, tiny_core
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine.engine import AsyncEngine

NO_EOS = {"1": -100}  # the tiny tokenizer's <eos>: a choice runs to max_tokens
TIMINGS = (
    "tokenmill_time_to_first_token_seconds",
    "tokenmill_time_per_output_token_seconds",
    "tokenmill_e2e_request_latency_seconds",
    "tokenmill_admission_wait_seconds",
)


@contextmanager
def tiny_client(**config: Any) -> Iterator[TestClient]:
    """The app on the real tiny engine (started and stopped by the app's lifespan)."""
    with TestClient(create_app(tiny_engine(), Config(**config)), raise_server_exceptions=False) as client:
        yield client


def usage_of(client: TestClient, payload: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": TINY_MODEL, **payload})
    assert response.status_code == 200, response.text
    if not payload.get("stream"):
        return dict(response.json()["usage"])
    chunks = parse_sse(response.text)
    assert chunks[-1] == "[DONE]"
    return dict(chunks[-2].get("usage") or {})  # none: the stream was not asked for its usage


def scrape_app(app: Any) -> Samples:
    response = run(lambda: get(app, "/metrics"))
    assert response.status_code == 200, response.text
    return parse(response.text)


def test_the_token_counters_are_the_sums_of_the_usage_returned() -> None:
    repeated = "a prompt sent twice, so the second one is read from the prefix cache"
    payloads = [
        {"prompt": repeated, "max_tokens": 5},
        {"prompt": repeated, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": ["one", "two words"], "max_tokens": 3, "n": 2},
    ]
    with tiny_client() as client:
        usages = [usage_of(client, payload) for payload in payloads]
        samples = scrape(client)
    for counter, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
        assert value(samples, f"tokenmill_{counter}_tokens_total", model=TINY_MODEL) == sum(u[field] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert value(samples, "tokenmill_cached_prompt_tokens_total", model=TINY_MODEL) == cached


def test_each_prompt_is_timed_once_streamed_or_not() -> None:
    with tiny_client() as client:
        counts = []
        for payload in (
            {"prompt": "plain", "max_tokens": 3, "logit_bias": NO_EOS},
            {"prompt": "streamed", "max_tokens": 3, "logit_bias": NO_EOS, "stream": True},
            {"prompt": ["two", "prompts"], "max_tokens": 3, "logit_bias": NO_EOS},
        ):
            usage_of(client, payload)
            samples = scrape(client)
            counts.append([value(samples, f"{name}_count", model=TINY_MODEL) for name in TIMINGS])
    assert counts == [[1] * 4, [2] * 4, [4] * 4]
    ttft, e2e = (value(samples, f"{name}_sum", model=TINY_MODEL) for name in (TIMINGS[0], TIMINGS[2]))
    assert 0 < ttft < e2e


def test_the_engine_series_agree_with_its_stats() -> None:
    with tiny_client(max_num_seqs=2) as client:
        usage_of(client, {"prompt": ["a", "b", "c"], "max_tokens": 4, "logit_bias": NO_EOS})
        stats = client.get("/stats").json()
        samples = scrape(client)
    m = {"model": TINY_MODEL}
    assert value(samples, "tokenmill_engine_step_seconds_count", **m) == stats["steps"] > 0
    assert value(samples, "tokenmill_engine_batch_size_count", **m) == stats["steps"]
    assert value(samples, "tokenmill_engine_step_tokens_sum", **m) == stats["tokens_computed"]
    assert value(samples, "tokenmill_engine_batch_size_bucket", le="1.0", **m) < stats["steps"]  # some batched 2
    assert value(samples, "tokenmill_kv_blocks_total", **m) == stats["num_used_blocks"] + stats["num_free_blocks"]
    assert value(samples, "tokenmill_kv_blocks_used", **m) == stats["num_used_blocks"] == 0
    assert value(samples, "tokenmill_running_sequences", **m) == value(samples, "tokenmill_waiting_sequences", **m) == 0
    assert value(samples, "tokenmill_preemptions_total", **m) == stats["num_preemptions"]


def test_each_model_has_its_own_series() -> None:
    engines = [AsyncEngine(tiny_core(), name, "fp_tiny") for name in ("alpha", "beta")]
    with TestClient(create_app(engines, Config())) as client:
        response = client.post("/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2})
        samples = scrape(client)
    usage = response.json()["usage"]
    assert value(samples, "tokenmill_prompt_tokens_total", model="beta") == usage["prompt_tokens"]
    assert value(samples, "tokenmill_prompt_tokens_total", model="alpha") == 0
    assert value(samples, "tokenmill_time_to_first_token_seconds_count", model="beta") == 1
    assert ("tokenmill_time_to_first_token_seconds_count", frozenset({("model", "alpha")})) not in samples
    assert value(samples, "tokenmill_engine_step_seconds_count", model="alpha") == 0
    assert value(samples, "tokenmill_engine_step_seconds_count", model="beta") > 0
    assert value(samples, "tokenmill_kv_blocks_total", model="alpha") == value(
        samples, "tokenmill_kv_blocks_total", model="beta"
    )


def test_speculation_counters_are_the_engines() -> None:
    engine = AsyncEngine(drafting_core(speculative="ngram"), TINY_MODEL, "fp_tiny")
    prompt = "abc abc abc abc abc abc abc abc"
    with TestClient(create_app([engine], Config())) as client:
        usage_of(client, {"prompt": prompt, "max_tokens": 30, "temperature": 0, "logit_bias": NO_EOS})
        stats = client.get("/stats").json()
        samples = scrape(client)
    m = {"model": TINY_MODEL}
    assert value(samples, "tokenmill_spec_decode_num_drafts_total", **m) == stats["spec_drafts"] > 0
    assert value(samples, "tokenmill_spec_decode_num_draft_tokens_total", **m) == stats["spec_draft_tokens"]
    assert value(samples, "tokenmill_spec_decode_num_accepted_tokens_total", **m) == stats["spec_accepted_tokens"]
    per_position = stats["spec_accepted_per_position"]
    assert (
        per_position
        and [
            value(samples, "tokenmill_spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **m)
            for i in range(len(per_position))
        ]
        == per_position
    )


def test_prefix_cache_tiers_have_series_per_tier(tmp_path: Any) -> None:
    """A prompt whose blocks were evicted comes back from RAM; its first blocks were written to disk too."""
    core = tiny_core(block_size=4, num_kv_blocks=24, kv_cache_ram_gb=0.01, kv_cache_dir=str(tmp_path))
    engine = AsyncEngine(core, TINY_MODEL, "fp_tiny")
    prompt = "a prompt long enough to fill a good few blocks of four tokens each"
    with TestClient(create_app([engine], Config())) as client:
        usage_of(client, {"prompt": prompt, "max_tokens": 2})
        for word in ("one", "two", "three"):
            usage_of(
                client, {"prompt": f"{word}: other text that takes the cache's blocks for itself", "max_tokens": 2}
            )
        usage = usage_of(client, {"prompt": prompt, "max_tokens": 2})
        core.blocks.tiers.disk.flush(30.0)
        stats = client.get("/stats").json()
        samples = scrape(client)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * stats["kv_ram_hits"] > 0
    for tier in ("ram", "disk"):
        m = {"model": TINY_MODEL, "tier": tier}
        assert value(samples, "tokenmill_kv_tier_bytes", **m) == stats[f"kv_{tier}_bytes"] > 0
        assert value(samples, "tokenmill_kv_tier_capacity_bytes", **m) == stats[f"kv_{tier}_capacity_bytes"] > 0
        assert value(samples, "tokenmill_kv_tier_hits_total", **m) == stats[f"kv_{tier}_hits"]
        assert value(samples, "tokenmill_kv_tier_written_bytes_total", **m) == stats[f"kv_bytes_to_{tier}"] > 0
        assert value(samples, "tokenmill_kv_tier_read_bytes_total", **m) == stats[f"kv_bytes_from_{tier}"]
    assert stats["kv_disk_written"] > 0


def test_the_suffix_store_is_per_api_key_and_its_memory_is_a_gauge() -> None:
    """A key's second request is drafted from its first; another key's same request is not."""
    engine = AsyncEngine(drafting_core(speculative="suffix"), TINY_MODEL, "fp_tiny")
    payload = {"model": TINY_MODEL, "prompt": "the quick brown fox", "max_tokens": 30, "temperature": 0}
    payload["logit_bias"] = NO_EOS

    def kept_by(client: TestClient, key: str) -> int:
        before = client.get("/stats", headers={"Authorization": f"Bearer {key}"}).json()["spec_accepted_tokens"]
        response = client.post("/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return (
            int(client.get("/stats", headers={"Authorization": f"Bearer {key}"}).json()["spec_accepted_tokens"])
            - before
        )

    with TestClient(create_app([engine], Config(api_key=("one", "two")))) as client:
        kept_by(client, "one")
        other, same = kept_by(client, "two"), kept_by(client, "one")
        stats = client.get("/stats", headers={"Authorization": "Bearer one"}).json()
        samples = parse(client.get("/metrics", headers={"Authorization": "Bearer one"}).text)
    assert same > other
    assert value(samples, "tokenmill_spec_decode_store_bytes", model=TINY_MODEL) == stats["spec_store_bytes"] > 0


@pytest.mark.parametrize(
    ("config", "probe", "reason", "other"),
    [
        ({"max_waiting_requests": 1}, body(), "busy_requests", "busy_tokens"),
        ({"max_waiting_tokens": 100}, body(prompt="x" * 100), "busy_tokens", "busy_requests"),
    ],
)
def test_a_429_is_counted_with_its_reason(
    config: dict[str, Any], probe: dict[str, Any], reason: str, other: str
) -> None:
    app = create_app(FakeEngine(hang_at_step=0), Config(**config))
    response, _ = run(lambda: hold_then_probe(app, 1, probe))
    assert response.status_code == 429
    samples = scrape_app(app)
    assert value(samples, "tokenmill_rate_limited_total", reason=reason) == 1
    assert value(samples, "tokenmill_rate_limited_total", reason=other) == 0
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status="429") == 1


def test_requests_are_counted_by_route_template_and_status_never_by_path(client: TestClient) -> None:
    assert client.get("/no/such/path").status_code == 404
    assert client.get("/v1/models/no-such-model").status_code == 404
    assert client.get("/v1/models").status_code == 200
    assert client.get("/").status_code == 200  # the playground page: a route of its own router
    samples = scrape(client)
    assert value(samples, "tokenmill_http_requests_total", route="/", status="200") == 1
    assert value(samples, "tokenmill_http_requests_total", route="unmatched", status="404") == 1
    assert value(samples, "tokenmill_http_requests_total", route="/v1/models/{model_id:path}", status="404") == 1
    assert value(samples, "tokenmill_http_requests_total", route="/v1/models", status="200") == 1
    assert not any("no-such" in str(labels) for _, labels in samples)
    assert not any(name.startswith("tokenmill_running") for name, _ in samples)  # a fake engine keeps no such stats


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_is_counted_as_an_abort(stream: bool) -> None:
    app = create_app(FakeEngine(hang_at_step=2), Config())  # two chunks, then nothing until the client leaves

    def sent_a_chunk(sent: list[dict[str, Any]]) -> bool:
        return not stream or any(m["type"] == "http.response.body" and m.get("body") for m in sent)

    run(lambda: call_then_disconnect(app, body(stream=stream), sent_a_chunk))
    samples = scrape_app(app)
    assert value(samples, "tokenmill_aborts_total", model="fake-model", reason="client_gone") == 1
    assert value(samples, "tokenmill_aborts_total", model="fake-model", reason="timeout") == 0
    assert ("tokenmill_request_failures_total", frozenset({("route", "/v1/completions")})) not in samples


@pytest.mark.parametrize(
    ("engine", "config", "stream", "status", "abort"),
    [
        (FakeEngine(hang_at_step=1), {"request_timeout_s": 0.05}, False, 504, "timeout"),
        (FakeEngine(hang_at_step=1), {"request_timeout_s": 0.05}, True, 200, "timeout"),
        (FakeEngine(error_at_step=1), {}, False, 500, None),
        (FakeEngine(error_at_step=1), {}, True, 200, None),  # the error frame comes after the 200
        (FakeEngine(raise_at_step=1), {}, False, 500, None),
    ],
)
def test_server_side_failures_are_counted_and_timeouts_as_aborts_too(
    engine: FakeEngine, config: dict[str, Any], stream: bool, status: int, abort: str | None
) -> None:
    with TestClient(create_app(engine, Config(**config)), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json=body(stream=stream))
        samples = scrape(client)
    assert response.status_code == status
    assert value(samples, "tokenmill_request_failures_total", route="/v1/completions") == 1
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status=str(status)) == 1
    assert value(samples, "tokenmill_aborts_total", model="fake-model", reason="timeout") == (abort == "timeout")


def test_metrics_need_the_key_unless_metrics_public() -> None:
    key = {"Authorization": "Bearer sk-metrics"}
    with TestClient(create_app(FakeEngine(), Config(api_key=("sk-metrics",)))) as keyed:
        assert keyed.get("/metrics").status_code == 401
        assert keyed.get("/metrics", headers=key).status_code == 200
    with TestClient(create_app(FakeEngine(), Config(api_key=("sk-metrics",), metrics_public=True))) as public:
        assert public.get("/metrics").status_code == 200
        assert public.get("/v1/models").status_code == 401  # only the scrape opens
        samples = scrape(public)
    assert value(samples, "tokenmill_http_requests_total", route="/v1/models", status="401") == 1


def test_apps_built_side_by_side_keep_their_own_counts() -> None:
    first, second = (create_app(FakeEngine(), Config()) for _ in range(2))
    run(lambda: post(first, "/v1/completions", body()))
    counts = [value(scrape_app(app), "tokenmill_prompt_tokens_total", model="fake-model") for app in (first, second)]
    assert counts[0] > 0 and counts[1] == 0


def test_a_scrape_is_openmetrics_when_asked_for() -> None:
    app = create_app(FakeEngine(), Config())
    response = run(lambda: get(app, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}))
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")
