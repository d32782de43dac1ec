"""Prometheus metrics, served at GET /metrics: one registry per app (never the global one), so tests build many apps.

Where each number comes from:
- HTTP requests, 429s and failures: the access-log middleware, once per response (access_log.py);
- tokens, time to first token, time per output token, latency, admission wait and aborts: each completion's record
  when it ends (record.py), per prompt;
- engine step time, batch size and tokens per step: the engine's step observer, on the engine thread
  (prometheus_client's metrics are thread-safe);
- running and waiting sequences, KV blocks and preemptions: the engine's stats, read at scrape time.
Per-model series carry a `model` label: its served id, never a value a client chose. Behind several ingress
processes, the counters and histograms /metrics shows are the sums over all of them (`show_counts`, cluster/ledger.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from tokenmill.api.engine_protocol import Engine
from tokenmill.api.rate_limit import UsageBook
from tokenmill.api.record import CompletionRecord
from tokenmill.engine.outputs import StepReport

ABORT_REASONS = ("client_gone", "timeout")  # a completion's outcomes that count as aborts
# why a 429: the waiting queue is full (admission.py), or a key's or user's rate limit is spent (rate_limit.py)
RATE_LIMIT_REASONS = ("busy_requests", "busy_tokens", "key_requests", "key_tokens", "user_requests", "user_tokens")

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self, engines: Mapping[str, Engine], user_usage: UsageBook | None = None) -> None:
        self.counted = CollectorRegistry()  # the counters and histograms this process adds to
        self.registry = CollectorRegistry()  # what /metrics shows: those, then what is read at scrape time
        self._counts: Collector = RegistryView(self.counted)
        self.registry.register(self._counts)
        self._define_http()
        self._define_completions()
        self._define_engine()
        self.registry.register(EngineStatsCollector(engines))
        if user_usage is not None:
            self.registry.register(UserUsageCollector(user_usage))
        for model in engines:  # every series a dashboard plots exists from the start, at zero
            for family in (self.prompt_tokens, self.completion_tokens, self.cached_tokens):
                family.labels(model)
            for reason in ABORT_REASONS:
                self.aborts.labels(model, reason)
        for reason in RATE_LIMIT_REASONS:
            self.rate_limited.labels(reason)

    def show_counts(self, counts: Collector) -> None:
        """Show `counts` in place of this process's own counters and histograms: behind several ingress processes,
        the totals of all of them (cluster/ledger.py)."""
        self.registry.unregister(self._counts)
        self._counts = counts
        self.registry.register(counts)

    def _define_http(self) -> None:
        r = self.counted
        self.requests = Counter(
            "tokenmill_http_requests",
            "HTTP requests answered, by route template and status",
            ["route", "status"],
            registry=r,
        )
        self.rate_limited = Counter(
            "tokenmill_rate_limited", "Requests refused with 429, by reason", ["reason"], registry=r
        )
        self.failures = Counter(
            "tokenmill_request_failures",
            "Requests that failed on the server's side: a 5xx status, or a stream that ended with a 5xx error frame",
            ["route"],
            registry=r,
        )

    def _define_completions(self) -> None:
        r, model = self.counted, ["model"]
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens the engine took in", model, registry=r)
        self.completion_tokens = Counter("tokenmill_completion_tokens", "Tokens generated", model, registry=r)
        self.cached_tokens = Counter(
            "tokenmill_cached_prompt_tokens", "Prompt tokens served from the prefix cache", model, registry=r
        )
        self.aborts = Counter(
            "tokenmill_aborts", "Completions stopped before their end, by reason", ["model", "reason"], registry=r
        )
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Request arrival to a prompt's first generated token",
            model,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "tokenmill_time_per_output_token_seconds",
            "A prompt's mean time per generated token after its first (its longest choice; two tokens or more)",
            model,
            registry=r,
            buckets=TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds",
            "Request arrival to a prompt's last output, for prompts that finished",
            model,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.admission_wait = Histogram(
            "tokenmill_admission_wait_seconds",
            "Admission to a prompt's first engine output (its time in the queue)",
            model,
            registry=r,
            buckets=WAIT_BUCKETS,
        )

    def _define_engine(self) -> None:
        r, model = self.counted, ["model"]
        self.step_time = Histogram(
            "tokenmill_engine_step_seconds", "Engine steps that ran a batch", model, registry=r, buckets=STEP_BUCKETS
        )
        self.batch_size = Histogram(
            "tokenmill_engine_batch_size",
            "Sequences in an engine step's batch",
            model,
            registry=r,
            buckets=BATCH_BUCKETS,
        )
        self.step_tokens = Histogram(
            "tokenmill_engine_step_tokens",
            "Tokens computed in an engine step (prefill chunks and decodes)",
            model,
            registry=r,
            buckets=STEP_TOKEN_BUCKETS,
        )

    # ---- observations ----
    def answered(self, route: str, status: int, failed: bool, rate_limit_reason: str | None) -> None:
        """One HTTP response: `failed` on the server's side; `rate_limit_reason` for a 429."""
        self.requests.labels(route, str(status)).inc()
        if status == 429:
            self.rate_limited.labels(rate_limit_reason or "unknown").inc()
        if failed:
            self.failures.labels(route).inc()

    def completion(self, record: CompletionRecord) -> None:
        model = record.model
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.completion_tokens.labels(model).inc(record.completion_tokens)
        self.cached_tokens.labels(model).inc(record.cached_tokens)
        for prompt in record.prompts:
            for histogram, value in (
                (self.ttft, prompt.ttft_s),
                (self.tpot, prompt.tpot_s),
                (self.e2e, prompt.e2e_s),
                (self.admission_wait, prompt.admission_wait_s),
            ):
                if value is not None:
                    histogram.labels(model).observe(value)
        if record.outcome in ABORT_REASONS:
            self.aborts.labels(model, record.outcome).inc()

    def step_observer(self, model: str) -> Callable[[StepReport], None]:
        """What the engine serving `model` calls after each step (on its own thread)."""
        step_time, batch_size, step_tokens = (
            h.labels(model) for h in (self.step_time, self.batch_size, self.step_tokens)
        )

        def observe(report: StepReport) -> None:
            step_time.observe(report.duration_s)
            batch_size.observe(report.num_seqs)
            step_tokens.observe(report.num_tokens)

        return observe

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape's body and content type (Prometheus text, or OpenMetrics when the scraper asks for it)."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class RegistryView:
    """Another registry's metrics, as a collector of this one."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.source = registry

    def collect(self) -> Iterable[Metric]:
        return self.source.collect()


class EngineStatsCollector:
    """Gauges of the engines' queues and KV cache and their preemption counter, read from `stats()` at scrape time.
    An engine without stats (or a stat) is left out."""

    GAUGES = (
        ("tokenmill_running_sequences", "Sequences in the running batch", "num_running"),
        ("tokenmill_waiting_sequences", "Sequences waiting to be scheduled", "num_waiting"),
        ("tokenmill_kv_blocks_used", "KV-cache blocks in use", "num_used_blocks"),
        ("tokenmill_spec_decode_store_bytes", "Memory of the speculative suffix store", "spec_store_bytes"),
    )
    # speculative decoding, by vLLM's names (engine/speculation.py)
    SPEC_COUNTERS = (
        ("tokenmill_spec_decode_num_drafts", "Drafts checked", "spec_drafts"),
        ("tokenmill_spec_decode_num_draft_tokens", "Draft tokens checked", "spec_draft_tokens"),
        ("tokenmill_spec_decode_num_accepted_tokens", "Draft tokens kept", "spec_accepted_tokens"),
        ("tokenmill_spec_decode_num_store_drafts", "Drafts from the shared suffix store", "spec_store_drafts"),
    )

    # the prefix cache's tiers (engine/kv_tiers.py), one series per tier: (name, doc, kind, its stat for ram and disk)
    TIER_FAMILIES = (
        ("tokenmill_kv_tier_bytes", "Prefix-cache blocks held in a tier, in bytes", "gauge", "{}_bytes"),
        ("tokenmill_kv_tier_capacity_bytes", "A tier's budget (0: off)", "gauge", "{}_capacity_bytes"),
        ("tokenmill_kv_tier_hits", "Prefix-cache blocks brought back from a tier", "counter", "{}_hits"),
        ("tokenmill_kv_tier_evictions", "Blocks a tier dropped for room", "counter", "{}_evictions"),
        ("tokenmill_kv_tier_written_bytes", "Bytes copied into a tier", "counter", "bytes_to_{}"),
        ("tokenmill_kv_tier_read_bytes", "Bytes brought back from a tier", "counter", "bytes_from_{}"),
    )

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.engines = engines

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        for model, engine in self.engines.items():
            counters = engine.stats()
            if counters is None:
                continue
            stats = dataclasses.asdict(counters)
            values = [stats.get(field) for _, _, field in self.GAUGES]
            used, free = stats.get("num_used_blocks"), stats.get("num_free_blocks")
            values.append(None if used is None or free is None else used + free)
            values.append(stats.get("num_preemptions"))
            values += [stats.get(field) for _, _, field in self.SPEC_COUNTERS]
            for family, value in zip(families, values):
                if value is not None:
                    family.add_metric([model], value)
            for position, accepted in enumerate(stats.get("spec_accepted_per_position") or ()):
                families[-1 - len(self.TIER_FAMILIES)].add_metric([model, str(position)], accepted)
            tiers = families[len(families) - len(self.TIER_FAMILIES) :]
            for family, (_, _, _, stat) in zip(tiers, self.TIER_FAMILIES):
                for tier in ("ram", "disk"):
                    value = stats.get("kv_" + stat.format(tier))
                    if value is not None:
                        family.add_metric([model, tier], value)
        return families

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily(name, doc, labels=["model"]) for name, doc, _ in self.GAUGES
        ]
        families.append(GaugeMetricFamily("tokenmill_kv_blocks_total", "KV-cache blocks in all", labels=["model"]))
        families.append(
            CounterMetricFamily("tokenmill_preemptions", "Sequences preempted for KV room", labels=["model"])
        )
        families += [CounterMetricFamily(name, doc, labels=["model"]) for name, doc, _ in self.SPEC_COUNTERS]
        families.append(
            CounterMetricFamily(
                "tokenmill_spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens kept, by their position in the draft",
                labels=["model", "position"],
            )
        )
        for name, doc, kind, _ in self.TIER_FAMILIES:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families.append(family(name, doc, labels=["model", "tier"]))
        return families


class UserUsageCollector:
    """Finished requests and their tokens per `user`, read at scrape time: the busiest users by a hash of the name
    and `other` for the rest (rate_limit.UserUsage), so a client cannot grow the series count. Gauges, not counters:
    a user rising into the top moves its count out of `other`."""

    def __init__(self, usage: UsageBook) -> None:
        self.usage = usage

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        requests, tokens = families = self._families()
        for row in self.usage.rows():
            requests.add_metric([row.user], row.requests)
            tokens.add_metric([row.user], row.tokens)
        return families

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "tokenmill_user_requests", "Finished requests per user (hashed; the rest as other)", labels=["user"]
            ),
            GaugeMetricFamily(
                "tokenmill_user_tokens",
                "Prompt + completion tokens of finished requests per user (hashed; the rest as other)",
                labels=["user"],
            ),
        ]
