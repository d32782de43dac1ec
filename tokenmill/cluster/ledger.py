"""The ledger: what every ingress replica must agree on, kept in one Serve replica that all of them call.

    ingress × N ──(each charge: check, acquire, refund)──► Ledger: the RateLimiter (api/rate_limit.py)
                ──(every PUSH_PERIOD_S: counts gained, usage)─►   the counters' totals, the per-user usage

- **Rate limits** are answered by the ledger's one RateLimiter at the moment of each charge, so a key's limits hold
  exactly whichever ingress a request reaches (a round trip to the ledger per charge: three per request).
- **Per-user usage** and **the HTTP and completion counters and histograms** are each ingress's own until it sends
  what they gained (every PUSH_PERIOD_S, and before it answers a scrape); the ledger adds them up, so /metrics on
  any ingress shows every ingress's counts, at most PUSH_PERIOD_S old for the others', and a killed ingress takes at
  most that much with it. Totals only grow: an ingress that restarts starts sending from zero again.

The ingress's side is cluster/ledger_client.py. The ledger is one replica with no CPU share: a charge is a dict lookup.
Its state is memory: if its process dies, Serve starts another with full buckets and the counts from zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.api.errors import APIError
from tokenmill.api.rate_limit import Clock, Headers, RateLimiter, UsageRow, UserUsage, answered
from tokenmill.config import Config

PUSH_PERIOD_S = 1.0  # how often an ingress sends its counts: the lag of /metrics and usage across ingresses
INGRESS_SILENT_S = 3 * PUSH_PERIOD_S  # an ingress not heard from for this long is no longer listed

Labels = tuple[tuple[str, str], ...]
Gain = tuple[str, str, str, str, Labels, float]  # family, its type, its help, sample name, labels, what it gained
Refusal = dict[str, Any]  # an APIError's fields (an exception's own pickling would lose them)
Answer = tuple[Headers, Refusal | None]
IngressId = tuple[str, int]  # Serve's replica id, process id


@dataclass
class FamilyTotal:
    """One counter or histogram family, added up over every ingress."""

    type: str
    documentation: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)  # in the order first seen


@dataclass
class LedgerCounts:
    """What a scrape reads from the ledger."""

    totals: dict[str, FamilyTotal]
    usage: list[UsageRow]
    ingresses: list[IngressId]  # those heard from within INGRESS_SILENT_S


class Ledger:
    """The deployment class (cluster/app.py binds it with one replica and no CPU share)."""

    def __init__(self, config: Config, clock: Clock = time.monotonic) -> None:
        self.limiter = RateLimiter.from_config(config, clock)
        self.usage = UserUsage()
        self.totals: dict[str, FamilyTotal] = {}
        self.clock = clock
        self.heard: dict[IngressId, float] = {}  # when each ingress last pushed

    # --- rate limits: what LocalLimits does in one process, answered here for every ingress ---
    def check(self, key: str, user: str | None) -> Answer:
        return self._answer(self._limiter().check, key, user)

    def acquire(self, key: str, user: str | None, tokens: int, requests: int, whole: int | None) -> Answer:
        return self._answer(self._limiter().acquire, key, user, tokens, requests, whole)

    def refund(self, key: str, user: str | None, requests: int, tokens: int) -> Answer:
        return self._answer(self._limiter().refund, key, user, requests, tokens)

    def headers(self, key: str, user: str | None) -> Headers:
        return self._limiter().headers(key, user)

    # --- counts ---
    def push(self, ingress: IngressId, gains: list[Gain], usage: list[tuple[str, int]]) -> None:
        """What one ingress's counters and histograms gained since its last push, and the requests it finished per
        user (`user` as the client sent it, tokens)."""
        self.heard[ingress] = self.clock()
        for name, kind, documentation, sample, labels, gained in gains:
            family = self.totals.setdefault(name, FamilyTotal(kind, documentation))
            family.samples[sample, labels] = family.samples.get((sample, labels), 0.0) + gained
        for user, tokens in usage:
            self.usage.record(user, tokens)

    def counts(self) -> LedgerCounts:
        now = self.clock()
        self.heard = {ingress: at for ingress, at in self.heard.items() if now - at <= INGRESS_SILENT_S}
        return LedgerCounts(self.totals, self.usage.rows(), sorted(self.heard))

    def _limiter(self) -> RateLimiter:
        if self.limiter is None:
            raise RuntimeError("the ledger was asked for a rate limit, and none is set")
        return self.limiter

    def _answer(self, call: Any, key: str, user: str | None, *args: Any) -> Answer:
        limiter = self._limiter()
        try:
            return answered(limiter, call, key, user, *args), None
        except APIError as exc:
            return limiter.headers(key, user), refusal_fields(exc)


def refusal_fields(exc: APIError) -> Refusal:
    return {
        "status": exc.status,
        "message": exc.message,
        "type": exc.type,
        "param": exc.param,
        "code": exc.code,
        "headers": dict(exc.headers or {}),
        "reason": exc.reason,
    }
