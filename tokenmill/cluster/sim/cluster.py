"""The simulated cluster: a proxy stage, the router of cluster/router.py, and N replicas, run as discrete events.

Every request first holds one of `proxies` FIFO servers for `s_router` seconds (HTTP ingress, the proxy and the
routing decision, all serial CPU), then the router places it by the live in-flight loads (Router: with affinity, the
first replica under the load bound in its prefix key's ring order; by prefix, the one with the fewest prompt tokens
to prefill before the prompt's first token; else the less loaded of two at random, or each replica in turn). Figures are taken over a window that starts after the `warmup` share of the requests has
arrived (the caches start cold) and ends at the last arrival, so a saturated stage shows as its own rate.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.cluster.affinity import (
    DEFAULT_LOAD_FACTOR,
    HashRing,
    bounded_order,
    load_bound,
    soonest_first,
    two_choices,
)
from tokenmill.cluster.sim.replica import EngineLimits, Flight, Replica, ServiceTimes
from tokenmill.cluster.sim.trace import Arrival, Workload, make_trace, option


@dataclass(frozen=True)
class SimConfig:
    times: ServiceTimes = field(default_factory=ServiceTimes)
    engine: EngineLimits = field(default_factory=EngineLimits)
    workload: Workload = field(default_factory=Workload)
    load: float = option(0.7, "offered load as a fraction of the capacity model's cold-cache cluster ceiling")
    rate: float | None = option(None, "offered requests/s, the same for every replica count (overrides --load)")
    proxies: int = option(1, "proxy processes, each serving one request at a time")
    load_factor: float = option(DEFAULT_LOAD_FACTOR, "c of the bounded-load rule: a replica's most, over its share")
    requests_per_replica: int = option(500, "requests in a run, per replica")
    max_requests: int = option(8000, "most requests in one run: at 100 replicas a run has fewer per replica")
    warmup: float = option(0.2, "share of the first requests left out of the figures")
    seed: int = option(0, "seed of the trace and of the router's random choices")
    max_sim_s: float = option(3600.0, "simulated seconds after which a run stops")

    def __post_init__(self) -> None:
        if not 0 <= self.warmup < 1 or self.proxies < 1 or min(self.requests_per_replica, self.max_requests) < 2:
            raise ValueError("warmup must be in [0, 1), proxies at least 1, and a run at least 2 requests")
        if self.load <= 0 or (self.rate is not None and self.rate <= 0) or self.load_factor < 1:
            raise ValueError("load and rate must be positive and load_factor at least 1")

    def requests(self, replicas: int) -> int:
        return min(self.requests_per_replica * replicas, self.max_requests)


@dataclass(frozen=True)
class Capacity:
    """The capacity model: one replica's ceiling at a full batch, with the prefixes cold or cached, and the proxy's."""

    replica_rps_cold: float
    replica_rps_warm: float
    output_tokens: float  # per request, on average
    proxy_rps: float

    @classmethod
    def of(cls, cfg: SimConfig) -> Capacity:
        t, w, batch = cfg.times, cfg.workload, cfg.engine.max_num_seqs
        # at a full batch a request costs its prefill tokens, one row in each of its decode steps and 1/batch of
        # those steps' fixed cost (the budget left beside the decodes is assumed to cover the prefill)
        decode_s = w.mean_output_tokens * (t.t_per_seq + t.t_fixed / batch)
        cold = 1 / (w.mean_prompt_tokens * t.t_per_prefill_token + decode_s)
        warm = 1 / (w.mean_warm_tokens * t.t_per_prefill_token + decode_s)
        return cls(cold, warm, w.mean_output_tokens, cfg.proxies / t.s_router)

    def cluster_rps(self, replicas: int, warm: bool) -> float:
        return min(replicas * (self.replica_rps_warm if warm else self.replica_rps_cold), self.proxy_rps)

    def binds(self, replicas: int, warm: bool) -> str:
        return "proxy" if self.cluster_rps(replicas, warm) == self.proxy_rps else "replicas"


def offered_rate(cfg: SimConfig, replicas: int) -> float:
    return cfg.rate if cfg.rate is not None else cfg.load * Capacity.of(cfg).cluster_rps(replicas, warm=False)


ROUTINGS = ("two-choices", "round-robin", "affinity", "prefix")


class Router:
    """How a request picks its replica, by `routing`: the less loaded of two at random (`two-choices`, the router
    without affinity), each in turn (`round-robin`, a plain load balancer), cluster/router.py's affinity rule (the
    prefix key's ring order under the load bound), or `prefix`: under the load bound, the replica with the fewest prompt
    tokens to prefill before the prompt's first token, its backlog and the part of the prompt its cache does not hold
    (cluster/router.py's rule where replicas report their blocks and backlogs; `cached` reads a replica's cache and
    `backlog` its queue, with no report's lag). Notes how far any placement went past the load bound."""

    def __init__(
        self,
        names: Sequence[str],
        routing: str,
        load_factor: float,
        rng: random.Random,
        cached: Callable[[str, tuple[int, ...]], int] | None = None,
        backlog: Callable[[str], int] | None = None,
        block_size: int = 16,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.names = list(names)
        self.routing = routing
        self.load_factor = load_factor
        self.rng = rng
        self.cached = cached
        self.backlog = backlog
        self.block_size = block_size
        self.ring = HashRing(self.names)
        self._orders: dict[int, list[str]] = {}  # a trace has few keys, and walking the ring is the slow part
        self._turn = itertools.cycle(self.names)
        self.worst_over_bound = -len(self.names)  # max of (load after placing - bound): above 0 breaks the bound

    def pick(self, arrival: Arrival, loads: dict[str, int]) -> str:
        bound = load_bound(sum(loads.values()), len(self.names), self.load_factor)
        if self.routing == "round-robin":
            return next(self._turn)
        if self.routing == "prefix" and self.cached is not None and self.backlog is not None:
            chosen = self._soonest(arrival, loads)
        elif self.routing == "affinity" and arrival.key is not None:
            order = self._orders.get(arrival.key) or self._orders.setdefault(arrival.key, self.ring.order(arrival.key))
            chosen = bounded_order(order, loads, self.load_factor)[0]
        else:
            return min(two_choices(self.names, self.rng), key=loads.__getitem__)
        self.worst_over_bound = max(self.worst_over_bound, loads[chosen] + 1 - bound)
        return chosen

    def _soonest(self, arrival: Arrival, loads: dict[str, int]) -> str:
        """cluster/router.py's rule (affinity.soonest_first): under the load bound, the replica with the fewest prompt
        tokens to prefill before this prompt's first token, its backlog and the part of the prompt it does not hold."""
        assert self.cached is not None and self.backlog is not None
        if arrival.key is None:
            return min(two_choices(self.names, self.rng), key=loads.__getitem__)
        order = self._orders.get(arrival.key) or self._orders.setdefault(arrival.key, self.ring.order(arrival.key))
        backlog = {
            name: self.backlog(name) + arrival.uncached_tokens(self.cached(name, arrival.block_hashes), self.block_size)
            for name in self.names
        }
        return soonest_first(order, backlog, loads, self.load_factor)[0]


@dataclass(frozen=True)
class SimResult:
    replicas: int
    routing: str
    offered_rps: float
    completed_rps: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    cached_fraction: float  # of the measured requests' prompt tokens, those found in a prefix cache
    proxy_util: float
    replica_busy: float  # share of the time the replicas spend stepping, mean over replicas
    replica_load: float  # the same with each step's fixed cost as a full batch would share it: 1 at the ceiling
    unfinished: int  # requests still in flight when the run stopped at max_sim_s
    worst_over_bound: int
    routed: dict[str, int]  # requests each replica took
    same_replica: float  # of the requests after a group's (a user's) first, the share sent where its previous one went


def simulate(cfg: SimConfig, replicas: int, routing: str) -> SimResult:
    rate = offered_rate(cfg, replicas)
    trace = make_trace(cfg.workload, rate, cfg.requests(replicas), cfg.seed)
    return ClusterSim(cfg, replicas, routing, trace).run()


class ClusterSim:
    def __init__(self, cfg: SimConfig, replicas: int, routing: str, trace: list[Arrival]) -> None:
        self.cfg = cfg
        self.fleet = {
            f"r{i}": Replica(f"r{i}", cfg.engine, cfg.times, cfg.workload.block_size) for i in range(replicas)
        }
        self.loads = dict.fromkeys(self.fleet, 0)
        cached = self._cached
        self.router = Router(
            list(self.fleet),
            routing,
            cfg.load_factor,
            random.Random(cfg.seed + 1),
            cached,
            self._backlog,
            cfg.workload.block_size,
        )
        self.flights = [Flight(a) for a in trace]
        self.skip = min(
            int(len(trace) * cfg.warmup), len(trace) - 2
        )  # the first requests meet cold caches: left out of the figures
        self.window = (trace[self.skip].arrival_s, trace[-1].arrival_s)
        self._order = itertools.count()  # ties in time go in the order they were scheduled
        # (time, tie, what): a Flight leaves the proxy and is routed; a Replica's step ends
        self.events: list[tuple[float, int, Flight | Replica]] = []
        self.exits = self._proxy_exits()
        for flight, exit_s in zip(self.flights, self.exits, strict=True):
            heapq.heappush(self.events, (exit_s, next(self._order), flight))
        self.busy_at: list[tuple[float, float]] = []  # the fleet's (busy, work) seconds as the window opens, closes

    def _proxy_exits(self) -> list[float]:
        """When each request leaves the proxy: FIFO onto the first free of `proxies` servers, s_router each."""
        free = [0.0] * self.cfg.proxies
        exits = []
        for flight in self.flights:
            start = max(flight.arrival.arrival_s, heapq.heappop(free))
            heapq.heappush(free, start + self.cfg.times.s_router)
            exits.append(start + self.cfg.times.s_router)
        return exits

    def run(self) -> SimResult:
        while self.events and self.events[0][0] <= self.cfg.max_sim_s:
            now, _, what = heapq.heappop(self.events)
            while len(self.busy_at) < 2 and now >= self.window[len(self.busy_at)]:
                self.busy_at.append(self._fleet_busy())
            replica = self._route(what) if isinstance(what, Flight) else self._end_step(what, now)
            if replica is not None and (duration := replica.start_step()) is not None:
                heapq.heappush(self.events, (now + duration, next(self._order), replica))
        return self._result()

    def _fleet_busy(self) -> tuple[float, float]:
        return sum(r.busy_s for r in self.fleet.values()), sum(r.work_s for r in self.fleet.values())

    def _backlog(self, name: str) -> int:
        return self.fleet[name].prefill_backlog

    def _cached(self, name: str, hashes: tuple[int, ...]) -> int:
        return self.fleet[name].cache.peek(hashes)

    def _route(self, flight: Flight) -> Replica | None:
        """Place a request; the replica when it was idle and must start stepping."""
        replica = self.fleet[self.router.pick(flight.arrival, self.loads)]
        replica.add(flight)
        self.loads[replica.name] += 1
        return None if replica.stepping else replica

    def _end_step(self, replica: Replica, now: float) -> Replica:
        self.loads[replica.name] -= len(replica.finish_step(now))
        return replica

    def _result(self) -> SimResult:
        start, end = self.window
        span = max(end - start, 1e-9)
        (busy_0, work_0), (busy_1, work_1) = self.busy_at + [self._fleet_busy()] * (2 - len(self.busy_at))
        done_in_window = [f for f in self.flights if f.done_s is not None and start <= f.done_s <= end]
        exits_in_window = sum(1 for e in self.exits if start <= e <= end)
        measured = self.flights[self.skip :]
        finished = [f for f in measured if f.done_s is not None]
        ttft_p50, ttft_p99 = p50_p99([t for f in finished if (t := f.ttft_s) is not None] or [0.0])
        e2e_p50, e2e_p99 = p50_p99([t for f in finished if (t := f.latency_s) is not None] or [0.0])
        routed = Counter(f.replica for f in self.flights)
        return SimResult(
            replicas=len(self.fleet),
            routing=self.router.routing,
            offered_rps=(len(self.flights) - 1 - self.skip) / span,  # arrivals after the window's first
            completed_rps=len(done_in_window) / span,
            output_tok_s=sum(f.arrival.output_tokens for f in done_in_window) / span,
            ttft_p50_s=ttft_p50,
            ttft_p99_s=ttft_p99,
            e2e_p50_s=e2e_p50,
            e2e_p99_s=e2e_p99,
            cached_fraction=sum(f.cached_tokens for f in finished)
            / max(sum(f.arrival.prompt_tokens for f in finished), 1),
            proxy_util=exits_in_window * self.cfg.times.s_router / (self.cfg.proxies * span),
            replica_busy=(busy_1 - busy_0) / (len(self.fleet) * span),
            replica_load=(work_1 - work_0) / (len(self.fleet) * span),
            unfinished=sum(1 for f in self.flights if f.done_s is None),
            worst_over_bound=self.router.worst_over_bound,
            routed={name: routed[name] for name in self.fleet},
            same_replica=same_replica_share(self.flights),
        )


def same_replica_share(flights: Sequence[Flight]) -> float:
    """Of the requests after their group's first (a prefix group's, or a user's), in arrival order, the share routed
    to the replica that took the group's previous request: how often a shared prefix meets the cache that holds it."""
    last: dict[int, str | None] = {}
    same = following = 0
    for flight in sorted(flights, key=lambda f: f.arrival.arrival_s):
        group = flight.arrival.group
        if group in last:
            following += 1
            same += flight.replica == last[group]
        last[group] = flight.replica
    return same / following if following else 1.0


def p50_p99(values: Sequence[float]) -> tuple[float, float]:
    """The 50th and 99th percentiles, interpolated between the closest ranks (numpy's default)."""
    if len(values) < 2:  # statistics.quantiles needs two
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[98]
