"""An ingress's side of the ledger (cluster/ledger.py): the SharedBooks that api/create_app runs on behind replicas.

- `SharedLimits` is the app's LimitStore: each charge is a call to the ledger, answered from its one RateLimiter.
- `SharedUsage` keeps the requests this ingress finished per user until the next push; its rows are the ledger's.
- `SharedCounts` shows the ledger's totals of every ingress's counters and histograms in this ingress's /metrics.
- `LedgerClient.run` pushes what this ingress's counters gained, every PUSH_PERIOD_S; `refresh` pushes and then
  reads the totals, before a scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from tokenmill.api.app import SharedBooks
from tokenmill.api.errors import APIError
from tokenmill.api.rate_limit import OTHER, Headers, UsageRow
from tokenmill.cluster.ledger import (
    INGRESS_SILENT_S,
    PUSH_PERIOD_S,
    Answer,
    FamilyTotal,
    Gain,
    IngressId,
    Labels,
    LedgerCounts,
)

log = logging.getLogger(__name__)

LAST_PUSH_TIMEOUT_S = 5.0  # a stopping ingress's last push, if the ledger still answers
ADDED_UP = ("counter", "histogram")  # the families whose samples add across ingresses (gauges are read at scrape)


class SharedLimits:
    """The LimitStore of every ingress: the ledger's buckets."""

    def __init__(self, ledger: DeploymentHandle) -> None:
        self.ledger = ledger

    async def check(self, key: str, user: str | None) -> Headers:
        return _answered(await self.ledger.check.remote(key, user))

    async def acquire(
        self, key: str, user: str | None, tokens: int, requests: int = 1, whole: int | None = None
    ) -> Headers:
        return _answered(await self.ledger.acquire.remote(key, user, tokens, requests, whole))

    async def refund(self, key: str, user: str | None, requests: int, tokens: int) -> Headers:
        return _answered(await self.ledger.refund.remote(key, user, requests, tokens))

    async def headers(self, key: str, user: str | None) -> Headers:
        headers: Headers = await self.ledger.headers.remote(key, user)
        return headers


def _answered(answer: Answer) -> Headers:
    headers, refusal = answer
    if refusal is not None:
        raise APIError(**refusal)
    return headers


class SharedUsage:
    """The UsageBook behind several ingresses: records wait here for the next push; rows are the ledger's, as of
    the last refresh."""

    def __init__(self) -> None:
        self.unsent: list[tuple[str, int]] = []
        self.last_rows: list[UsageRow] = [UsageRow(OTHER, 0, 0)]

    def record(self, user: str, tokens: int) -> None:
        self.unsent.append((user, tokens))

    def rows(self) -> list[UsageRow]:
        return self.last_rows

    def take(self) -> list[tuple[str, int]]:
        unsent, self.unsent = self.unsent, []
        return unsent


class SharedCounts:
    """Every ingress's counters and histograms, as the ledger added them up at the last refresh, and the ingresses
    it heard from."""

    def __init__(self) -> None:
        self.totals: dict[str, FamilyTotal] = {}
        self.ingresses: list[IngressId] = []

    def collect(self) -> Iterable[Metric]:
        families = []
        for name, total in self.totals.items():
            family = Metric(name, total.documentation, total.type)
            for (sample, labels), value in total.samples.items():
                family.add_sample(sample, dict(labels), value)
            families.append(family)
        info = GaugeMetricFamily(
            "tokenmill_ingress_info",
            f"1 per ingress replica heard from in the last {INGRESS_SILENT_S:.0f} s, with its process id",
            labels=["ingress", "pid"],
        )
        for ingress, pid in self.ingresses:
            info.add_metric([ingress, str(pid)], 1)
        return [*families, info]


class Gains:
    """What a registry's counters and histograms gained since the last push that reached the ledger."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.sent: dict[tuple[str, Labels], float] = {}

    def take(self) -> tuple[list[Gain], dict[tuple[str, Labels], float]]:
        """The gains, and the values to remember as sent once the ledger has them."""
        gains, values = [], {}
        for family in self.registry.collect():
            if family.type not in ADDED_UP:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a time, not a count
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                before = self.sent.get(key)
                if before is None or sample.value != before:  # a new series goes once at zero, so it shows
                    gains.append((family.name, family.type, family.documentation, *key, sample.value - (before or 0)))
                    values[key] = sample.value
        return gains, values


class LedgerClient:
    def __init__(self, ledger: DeploymentHandle, limits_on: bool, ingress: IngressId) -> None:
        self.ledger = ledger
        self.ingress = ingress
        self.gains = Gains(CollectorRegistry())  # until count_from names the app's
        self.usage = SharedUsage()
        self.counts = SharedCounts()
        self.books = SharedBooks(
            limits=SharedLimits(ledger) if limits_on else None,
            usage=self.usage,
            counts=self.counts,
            refresh=self.refresh,
            run=self.run,
        )
        self._pushing = asyncio.Lock()  # one push at a time, so no gain is taken twice or lost between two

    def count_from(self, counted: CollectorRegistry) -> None:
        """The registry of the counters and histograms this ingress adds to (its app's, made with the books)."""
        self.gains = Gains(counted)

    async def push(self) -> None:
        async with self._pushing:
            (gains, values), usage = self.gains.take(), self.usage.take()
            try:  # an empty push too: it says this ingress is alive
                await self.ledger.push.remote(self.ingress, gains, usage)
            except BaseException:
                self.usage.unsent[:0] = usage  # not sent: they go with the next push
                raise
            self.gains.sent.update(values)

    async def refresh(self) -> None:
        await self.push()
        counts: LedgerCounts = await self.ledger.counts.remote()
        self.counts.totals, self.counts.ingresses, self.usage.last_rows = counts.totals, counts.ingresses, counts.usage

    async def run(self) -> None:
        """Push every PUSH_PERIOD_S until cancelled, then once more (a stopping ingress sends what it counted)."""
        try:
            while True:
                await asyncio.sleep(PUSH_PERIOD_S)
                try:
                    await self.push()
                except RayError as exc:  # the ledger restarting: these counts go with the next push
                    log.warning("could not send this ingress's counts to the ledger: %s", exc)
        finally:
            await asyncio.shield(asyncio.wait_for(self.push(), LAST_PUSH_TIMEOUT_S))
