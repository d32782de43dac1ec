from __future__ import annotations

import pytest

from tokenmill.bench.stats import (
    RequestResult,
    flat_figures,
    median_of_rounds,
    percentile,
    summarize_level,
    summarize_single,
)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 50, 5.0),
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),  # order does not matter
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 25, 2.0),
        (list(map(float, range(1, 101))), 99, 99.01),  # numpy: np.percentile(range(1, 101), 99)
        ([0.0, 10.0], 99, 9.9),
    ],
)
def test_percentile_interpolates_between_closest_ranks(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def ok(latency: float, ttft: float, tokens: int, last: float | None = None, finish: str = "length") -> RequestResult:
    return RequestResult(True, latency, ttft, last if last is not None else latency, tokens, True, finish)


def test_decode_rate_counts_tokens_after_the_first_over_first_to_last() -> None:
    assert ok(latency=2.0, ttft=0.5, tokens=4, last=2.0).decode_tok_s == pytest.approx(3 / 1.5)
    assert ok(latency=1.0, ttft=0.5, tokens=1).decode_tok_s is None  # one token: no decode span
    assert RequestResult(False, 1.0, None, None, 0, True, None, "x").decode_tok_s is None


def test_level_summary_aggregates_over_wall_time_and_leaves_out_failures() -> None:
    results = [
        ok(1.0, 0.1, 10),
        ok(2.0, 0.2, 10),
        ok(3.0, 0.3, 8, finish="stop"),
        RequestResult(False, 0.5, None, None, 0, True, None, "HTTP 500"),
    ]
    summary = summarize_level(results, wall_s=4.0, concurrency=2)
    assert summary["requests"] == 4 and summary["failed"] == 1 and summary["early_stops"] == 1
    assert summary["completion_tokens"] == 28
    assert summary["agg_tok_s"] == pytest.approx(7.0)
    assert summary["latency_p50_s"] == pytest.approx(2.0)
    assert summary["latency_p99_s"] == pytest.approx(2.98)
    assert summary["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["tokens_exact"] is True


def test_level_summary_of_only_failures_has_no_figures() -> None:
    summary = summarize_level([RequestResult(False, 0.5, None, None, 0, True, None, "x")], wall_s=1.0, concurrency=1)
    assert summary["agg_tok_s"] is None and summary["latency_p50_s"] is None and summary["ttft_p99_s"] is None


def test_single_summary_is_the_median_over_runs() -> None:
    results = [ok(3.0, 0.2, 11, last=2.2), ok(2.0, 0.4, 11, last=1.4), ok(9.0, 1.0, 11, last=6.0)]
    summary = summarize_single(results)
    assert summary["decode_tok_s"] == pytest.approx(5.0)  # rates 5, 10, 2
    assert summary["ttft_s"] == pytest.approx(0.4)
    assert summary["completion_tokens"] == [11, 11, 11]


def test_median_of_rounds_skips_missing_values() -> None:
    merged = median_of_rounds([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "c": None}])
    assert merged == {"a": 2.0, "b": 2.0, "c": None}


def test_flat_figures_names_each_level_by_its_concurrency() -> None:
    single = summarize_single([ok(2.0, 0.5, 4, last=2.0)])
    levels = [summarize_level([ok(1.0, 0.1, 10)], 1.0, 1), summarize_level([ok(1.0, 0.1, 10)] * 4, 2.0, 4)]
    figures = flat_figures(single, levels)
    assert figures["decode_tok_s"] == pytest.approx(2.0)
    assert figures["c1_agg_tok_s"] == pytest.approx(10.0)
    assert figures["c4_agg_tok_s"] == pytest.approx(20.0)
    assert set(figures) >= {"ttft_s", "c4_latency_p99_s", "c4_ttft_p50_s", "c1_ttft_p99_s"}
