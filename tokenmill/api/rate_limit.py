"""Rate limits per API key and per `user` within a key: continuously refilling buckets, OpenAI's 429 and headers.

Each limit (requests or tokens; per key, or per (key, user)) is a bucket holding up to N that refills at N per period,
continuously: after a burst empties it, capacity comes back a little at a time, not all at once at the top of the
minute. A request needs room in every bucket that applies to it and is charged to all of them only when it fits in
all, so a 429 costs nothing. Its tokens are its prompt tokens plus max_tokens for every sequence it may generate,
charged up front; what the sequences did not generate is refunded when it ends, so a finished request has cost its
usage's total_tokens whether it streamed or not. A request larger than a limit itself gets a 429 that says so and
has no Retry-After, since no wait lets it through.

Tokenising costs the server too, so it is paid for before it is done: once a request's body is checked, the request
and the fewest tokens its prompts can be (limits.TextBound: from their length, without tokenising) are charged
(Quota.prepay), and the rest of its tokens once they are known. A request refused after that point (a 429 for the
rest, or a 400 that only its tokens or its grammar reveal) keeps what it prepaid, as OpenAI counts failed requests
against a limit: a limited key cannot have text tokenised faster than its limits allow. A 400 the body alone shows,
or a 429 before the prepayment, costs nothing.

Keys and user names are held only as hashes. A bucket that is full again is the same as no bucket, so full ones are
dropped and memory follows the users active within one period. Everything runs on the event loop: no locks.

Where the buckets live is a LimitStore: this process's RateLimiter (LocalLimits), or, behind several ingress replicas,
one store that all of them call (cluster/ledger.py), so a key's limit is the same whichever ingress a request reaches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.api import errors
from tokenmill.api.record import pseudonym
from tokenmill.config import Config, Rate, parse_rate

REQUESTS, TOKENS = "requests", "tokens"  # the two dimensions, as OpenAI names them in the 429's type and the headers
ANONYMOUS = "anonymous"  # the key of every request to a server without --api-key
OTHER = "other"  # the usage row of every user outside the top ones
SWEEP_INTERVAL_S = 1.0  # how often full buckets are looked for and dropped
EPSILON = 1e-9  # a refill of whole tokens can land a hair below the integer it should reach

Clock = Callable[[], float]
Headers = dict[str, str]


@dataclass(frozen=True)
class Limit:
    dimension: str  # REQUESTS or TOKENS
    rate: Rate
    per_user: bool  # one bucket per (key, user) instead of per key

    @property
    def reason(self) -> str:
        """Its 429s' label in /metrics: key_requests, key_tokens, user_requests or user_tokens."""
        return f"{'user' if self.per_user else 'key'}_{self.dimension}"

    @property
    def holder(self) -> str:
        return "this `user` of the API key" if self.per_user else "this API key"


@dataclass
class Bucket:
    capacity: int
    period_s: float
    level: float
    at: float  # when `level` was last brought up to date

    @classmethod
    def full(cls, rate: Rate, now: float) -> Bucket:
        return cls(rate.count, rate.period_s, float(rate.count), now)

    def refill(self, now: float) -> Bucket:
        gained = max(now - self.at, 0.0) * self.capacity / self.period_s
        self.level, self.at = min(float(self.capacity), self.level + gained), now
        return self

    def refund(self, amount: int, now: float) -> None:
        self.refill(now)
        self.level = min(float(self.capacity), self.level + amount)

    def wait_s(self, cost: int) -> float:
        """Seconds until `cost` fits (0: it fits now)."""
        short = cost - self.level
        return 0.0 if short <= EPSILON else short * self.period_s / self.capacity

    @property
    def remaining(self) -> int:
        return max(math.floor(self.level + EPSILON), 0)

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return self.wait_s(self.capacity)

    @property
    def is_full(self) -> bool:
        return self.level >= self.capacity - EPSILON


BucketId = tuple[Limit, str, str | None]  # (limit, key hash, user hash for a per-user limit)


class RateLimiter:
    def __init__(self, limits: Sequence[Limit], clock: Clock = time.monotonic) -> None:
        self.limits = tuple(limits)
        self.clock = clock
        self._buckets: dict[BucketId, Bucket] = {}
        self._swept_at = clock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock = time.monotonic) -> RateLimiter | None:
        """None when no limit is set."""
        settings = [
            (REQUESTS, False, config.rate_limit_requests),
            (TOKENS, False, config.rate_limit_tokens),
            (REQUESTS, True, config.rate_limit_user_requests),
            (TOKENS, True, config.rate_limit_user_tokens),
        ]
        limits = [Limit(dimension, parse_rate(text), per_user) for dimension, per_user, text in settings if text]
        return cls(limits, clock) if limits else None

    @property
    def bucket_count(self) -> int:
        return len(self._buckets)

    def check(self, key: str, user: str | None) -> None:
        """Raise the 429 a request would get for lack of requests, charging nothing (its tokens are not known yet)."""
        self._fitting(key, user, tokens=0)

    def acquire(self, key: str, user: str | None, tokens: int, requests: int = 1, whole: int | None = None) -> None:
        """Charge `requests` and `tokens` to every bucket of `key` and `user`, or raise 429 and charge none.
        `whole`: the request's whole token cost, when part of it was charged before (past a capacity it never fits)."""
        for bucket_id, bucket, cost in self._fitting(key, user, tokens, requests, whole):
            bucket.level -= cost
            self._buckets[bucket_id] = bucket

    def refund(self, key: str, user: str | None, requests: int, tokens: int) -> None:
        now = self._now()
        for bucket_id in self._bucket_ids(key, user):
            bucket = self._buckets.get(bucket_id)
            if bucket is not None:  # a dropped bucket was full: nothing to give back
                bucket.refund(_cost(bucket_id, requests, tokens), now)

    def headers(self, key: str, user: str | None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, for each dimension that has a limit: the tightest of its buckets."""
        now = self._now()
        result = {}
        for dimension in (REQUESTS, TOKENS):
            ids = [bucket_id for bucket_id in self._bucket_ids(key, user) if bucket_id[0].dimension == dimension]
            if not ids:
                continue
            tightest = min((self._bucket(bucket_id, now) for bucket_id in ids), key=lambda b: (b.remaining, -b.reset_s))
            result[f"x-ratelimit-limit-{dimension}"] = str(tightest.capacity)
            result[f"x-ratelimit-remaining-{dimension}"] = str(tightest.remaining)
            result[f"x-ratelimit-reset-{dimension}"] = duration(tightest.reset_s)
        return result

    def _fitting(
        self, key: str, user: str | None, tokens: int, requests: int = 1, whole: int | None = None
    ) -> list[tuple[BucketId, Bucket, int]]:
        """Every bucket of this request with its cost, once all of them have room; else the 429."""
        now = self._now()
        entries = [(i, self._bucket(i, now), _cost(i, requests, tokens)) for i in self._bucket_ids(key, user)]
        for bucket_id, bucket, cost in entries:
            size = _cost(bucket_id, requests, tokens if whole is None else whole)
            if size > bucket.capacity:
                raise _too_large(bucket_id[0], size)
        short = [(bucket.wait_s(cost), bucket_id[0], bucket, cost) for bucket_id, bucket, cost in entries]
        short = [entry for entry in short if entry[0] > 0]
        if short:
            raise _limited(*max(short, key=lambda entry: entry[0]))
        return entries

    def _bucket_ids(self, key: str, user: str | None) -> list[BucketId]:
        user_hash = pseudonym(user) if user is not None else None
        return [
            (limit, key, user_hash if limit.per_user else None)
            for limit in self.limits
            if user is not None or not limit.per_user
        ]

    def _bucket(self, bucket_id: BucketId, now: float) -> Bucket:
        """The bucket, brought up to date; a full one (not yet kept) if it has none."""
        bucket = self._buckets.get(bucket_id)
        return bucket.refill(now) if bucket is not None else Bucket.full(bucket_id[0].rate, now)

    def _now(self) -> float:
        now = self.clock()
        if now - self._swept_at >= SWEEP_INTERVAL_S:
            self._swept_at = now
            self._buckets = {i: b for i, b in self._buckets.items() if not b.refill(now).is_full}
        return now


def _cost(bucket_id: BucketId, requests: int, tokens: int) -> int:
    return requests if bucket_id[0].dimension == REQUESTS else tokens


def _limited(wait_s: float, limit: Limit, bucket: Bucket, cost: int) -> errors.APIError:
    message = (
        f"Rate limit reached for {limit.holder} on {limit.dimension} per {limit.rate.unit}: Limit {bucket.capacity}, "
        f"Remaining {bucket.remaining}, Requested {cost}. Please try again in {duration(wait_s)}."
    )
    return errors.rate_limited(message, limit.dimension, max(math.ceil(wait_s - EPSILON), 1), limit.reason)


def _too_large(limit: Limit, cost: int) -> errors.APIError:
    """No wait makes room for it, so no Retry-After: the hosted API's 429 for this case, which names the cause."""
    message = (
        f"Request too large for {limit.holder} on {limit.dimension} per {limit.rate.unit}: Limit {limit.rate.count}, "
        f"Requested {cost}. The prompt or max_tokens x choices must be reduced for it to run."
    )
    return errors.rate_limited(message, limit.dimension, None, limit.reason)


def duration(seconds: float) -> str:
    """OpenAI's reset format (Go's durations): 0s, 20ms, 1s, 1.5s, 6m0s, 1h0m0s; rounded up to the millisecond."""
    ms = max(math.ceil(seconds * 1000 - EPSILON), 0)
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


class LimitStore(Protocol):
    """Where a server's buckets live. Each call answers with the x-ratelimit-* headers as they stand after it; a
    refusal raises the 429, its headers carrying them too."""

    async def check(self, key: str, user: str | None) -> Headers: ...

    async def acquire(
        self, key: str, user: str | None, tokens: int, requests: int = 1, whole: int | None = None
    ) -> Headers: ...

    async def refund(self, key: str, user: str | None, requests: int, tokens: int) -> Headers: ...

    async def headers(self, key: str, user: str | None) -> Headers: ...


class LocalLimits:
    """The LimitStore of one process: its RateLimiter, called in place."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    async def check(self, key: str, user: str | None) -> Headers:
        return answered(self.limiter, self.limiter.check, key, user)

    async def acquire(
        self, key: str, user: str | None, tokens: int, requests: int = 1, whole: int | None = None
    ) -> Headers:
        return answered(self.limiter, self.limiter.acquire, key, user, tokens, requests, whole)

    async def refund(self, key: str, user: str | None, requests: int, tokens: int) -> Headers:
        return answered(self.limiter, self.limiter.refund, key, user, requests, tokens)

    async def headers(self, key: str, user: str | None) -> Headers:
        return self.limiter.headers(key, user)


def answered(limiter: RateLimiter, call: Callable[..., None], key: str, user: str | None, *args: object) -> Headers:
    """`call(key, user, *args)`, then the headers after it; a 429 it raises carries them."""
    try:
        call(key, user, *args)
    except errors.APIError as exc:
        exc.headers = {**limiter.headers(key, user), **(exc.headers or {})}
        raise
    return limiter.headers(key, user)


def local_limits(config: Config, clock: Clock = time.monotonic) -> LocalLimits | None:
    """This process's store for the limits `config` sets; None when it sets none."""
    limiter = RateLimiter.from_config(config, clock)
    return LocalLimits(limiter) if limiter is not None else None


class Quota:
    """One completion's dealings with the limits (store None: limits are off): who asks, and what it was charged."""

    def __init__(self, store: LimitStore | None, key: str) -> None:
        self.store = store
        self.key = key
        self.user: str | None = None  # the request's `user`, once its body is read
        self._charged: int | None = None  # tokens charged, until settled
        self._headers: Headers | None = None  # as of the last answer from the store

    async def check(self) -> None:
        if self.store is not None:
            await self._answer(self.store.check(self.key, self.user))

    async def prepay(self, tokens: int) -> None:
        """Before its prompts are tokenised: charge the request and `tokens`, the fewest its prompts can be (429,
        charging nothing, if they do not fit). Whatever refuses the request after this, the charge stays."""
        await self.acquire(tokens)

    async def acquire(self, tokens: int) -> None:
        """Its whole token budget, `tokens`: charged, or what is left of it once prepaid (429 if that does not fit;
        what was prepaid stays charged)."""
        if self.store is None:
            return
        if self._charged is None:
            await self._answer(self.store.acquire(self.key, self.user, tokens))
        elif tokens > self._charged:
            await self._answer(self.store.acquire(self.key, self.user, tokens - self._charged, 0, tokens))
        elif tokens < self._charged:
            await self._answer(self.store.refund(self.key, self.user, 0, self._charged - tokens))
        self._charged = tokens

    async def cancel(self) -> None:
        """The request never ran (the server refused it): it costs nothing."""
        await self._settle(1, self._charged or 0)

    async def finish(self, used_tokens: int) -> None:
        """The request ran and used `used_tokens`: the rest of its charge comes back."""
        await self._settle(0, max((self._charged or 0) - used_tokens, 0))

    async def headers(self) -> Headers:
        """The x-ratelimit-* headers as of the last charge or refund (asked for, if there was none yet)."""
        if self.store is None:
            return {}
        if self._headers is None:
            self._headers = await self.store.headers(self.key, self.user)
        return self._headers

    async def _answer(self, call: Awaitable[Headers]) -> None:
        try:
            self._headers = await call
        except errors.APIError as exc:
            self._headers = {name: value for name, value in (exc.headers or {}).items() if name.startswith("x-")}
            raise

    async def _settle(self, requests: int, tokens: int) -> None:
        charged, self._charged = self._charged, None
        if self.store is not None and charged is not None:
            await self._answer(self.store.refund(self.key, self.user, requests, tokens))


# --- usage per user, for /metrics -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class UsageRow:
    user: str  # pseudonym(name), or OTHER
    requests: int
    tokens: int


class UsageBook(Protocol):
    """Where finished requests are counted per user: this process's UserUsage, or every ingress's (cluster/)."""

    def record(self, user: str, tokens: int) -> None: ...

    def rows(self) -> list[UsageRow]: ...


class UserUsage:
    """Finished requests and their tokens per `user` (every key together): the top users by a hash of the name and
    one `other` row for the rest, so the label set stays bounded however many users there are.

    Past `max_tracked` users, the less busy half is folded into `other` for good (a user who comes back starts a new
    count), so memory is bounded too. A row is a snapshot, not a counter: `other` shrinks when a user rises into the
    top."""

    def __init__(self, top_k: int = 10, max_tracked: int = 1024) -> None:
        self.top_k = top_k
        self.max_tracked = max_tracked
        self._users: dict[str, tuple[int, int]] = {}  # hashed name → (requests, tokens)
        self._folded = (0, 0)

    @property
    def tracked(self) -> int:
        return len(self._users)

    def record(self, user: str, tokens: int) -> None:
        name = pseudonym(user)
        requests, used = self._users.get(name, (0, 0))
        self._users[name] = (requests + 1, used + tokens)
        if len(self._users) > self.max_tracked:
            self._fold(self.max_tracked // 2)

    def rows(self) -> list[UsageRow]:
        """The top_k users by requests (then tokens), busiest first, and the `other` row (always present)."""
        ranked = self._ranked()
        rest = ranked[self.top_k :]
        other = UsageRow(
            OTHER, self._folded[0] + sum(r for _, (r, _) in rest), self._folded[1] + sum(t for _, (_, t) in rest)
        )
        return [UsageRow(name, r, t) for name, (r, t) in ranked[: self.top_k]] + [other]

    def _fold(self, keep: int) -> None:
        ranked = self._ranked()
        for _, (requests, tokens) in ranked[keep:]:
            self._folded = (self._folded[0] + requests, self._folded[1] + tokens)
        self._users = dict(ranked[:keep])

    def _ranked(self) -> list[tuple[str, tuple[int, int]]]:
        return sorted(self._users.items(), key=lambda item: (-item[1][0], -item[1][1], item[0]))
