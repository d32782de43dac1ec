"""Report math: percentiles, per-level and single-stream summaries, and the median over interleaved rounds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestResult:
    """One completion request as the client saw it. Times are seconds from sending the request."""

    ok: bool
    latency_s: float
    ttft_s: float | None  # first chunk carrying text
    last_token_s: float | None  # last chunk carrying text
    completion_tokens: int
    tokens_exact: bool  # from `usage` or a "length" finish; False: counted from stream chunks
    finish_reason: str | None
    error: str | None = None
    text_digest: str | None = None  # of the whole text streamed: tells whether two servers answered alike
    text: str | None = None  # the whole text streamed, where the caller asked to keep it (a conversation goes on)
    prompt_tokens: int | None = None  # from the stream's `usage`, where the server sends it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time between the first and the last: the pure decode rate."""
        if self.ttft_s is None or self.last_token_s is None or self.completion_tokens < 2:
            return None
        span = self.last_token_s - self.ttft_s
        return (self.completion_tokens - 1) / span if span > 0 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_level(results: Sequence[RequestResult], wall_s: float, concurrency: int) -> dict[str, Any]:
    """Aggregate tokens/s over the level's wall time, latency and TTFT percentiles over its successful requests."""
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    latencies = [r.latency_s for r in done]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(done),
        "early_stops": sum(1 for r in done if r.finish_reason == "stop"),
        "tokens_exact": all(r.tokens_exact for r in done),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "agg_tok_s": tokens / wall_s if wall_s > 0 and done else None,
        "latency_p50_s": percentile(latencies, 50) if latencies else None,
        "latency_p99_s": percentile(latencies, 99) if latencies else None,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
    }


def summarize_single(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Single-stream figures: the median decode rate and TTFT over sequential requests."""
    done = [r for r in results if r.ok]
    rates = [rate for r in done if (rate := r.decode_tok_s) is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "requests": len(results),
        "failed": len(results) - len(done),
        "early_stops": sum(1 for r in done if r.finish_reason == "stop"),
        "completion_tokens": [r.completion_tokens for r in done],
        "digests": [r.text_digest for r in results],
        "decode_tok_s": statistics.median(rates) if rates else None,
        "ttft_s": statistics.median(ttfts) if ttfts else None,
    }


def larger(a: float | None, b: float | None) -> float | None:
    """The larger of two figures either of which may be missing: a peak kept over several servers' runs."""
    return b if a is None else a if b is None else max(a, b)


def median_of_rounds(rounds: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure's median over the rounds that produced it (None where no round did)."""
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    merged: dict[str, float | None] = {}
    for key in keys:
        values = [v for r in rounds if (v := r.get(key)) is not None]
        merged[key] = statistics.median(values) if values else None
    return merged


def flat_figures(
    single: dict[str, Any] | None, levels: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]] = ()
) -> dict[str, float | None]:
    """The figures the report compares, under stable flat names (c16_agg_tok_s, c16_ttft_p50_s, prefill512_tok_s...)."""
    figures: dict[str, float | None] = {}
    if single is not None:
        figures["decode_tok_s"] = single["decode_tok_s"]
        figures["ttft_s"] = single["ttft_s"]
    for one in prefill:
        figures[f"prefill{one['length']}_tok_s"] = one["tok_s"]
    for level in levels:
        c = level["concurrency"]
        for key in ("agg_tok_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s"):
            figures[f"c{c}_{key}"] = level[key]
    return figures
