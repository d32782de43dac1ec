"""One simulated replica: a continuous-batching engine with a prefix cache, stepping in simulated time.

Each step decodes one token for every running sequence and spends what is left of the token budget on prefill chunks
of prompts, oldest first, admitting waiting prompts while the batch has room (as engine/scheduler.py does). A step
costs `ServiceTimes.step_s`. A prompt's leading blocks found in the replica's prefix cache at admission skip prefill;
its blocks enter the cache once its prefill is done. The cache is an LRU of `cache_blocks` block hashes beside the
running sequences' own blocks, standing for the freed blocks a real KV cache keeps hashed until they are reused.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

from tokenmill.cluster.sim.trace import Arrival, option


@dataclass(frozen=True)
class ServiceTimes:
    """Seconds of service. The defaults were measured on the 2-core development VM for the packaged 270M model: the
    engine's by scripts/replica_service_times.py --threads 2, the ingress's cost of a request of 64 streamed tokens
    (~14 ms + ~1.9 ms a token of CPU) by scripts/replica_bench.py; docs/scaling.md has the runs. Measure again for
    another model or machine and pass the figures as flags."""

    t_fixed: float = option(0.0148, "seconds of an engine step whatever its batch (weights read, LM head, overhead)")
    t_per_seq: float = option(0.00193, "seconds each decoding sequence adds to a step")
    t_per_prefill_token: float = option(0.000726, "seconds each prefilled (uncached) prompt token adds to a step")
    s_router: float = option(0.136, "seconds of serial proxy + ingress + routing CPU per request")

    def __post_init__(self) -> None:
        if min(self.t_fixed, self.t_per_seq, self.t_per_prefill_token) < 0 or self.s_router <= 0:
            raise ValueError("service times must not be negative, and s_router must be positive")

    def step_s(self, decode_seqs: int, prefill_tokens: int) -> float:
        return self.t_fixed + self.t_per_seq * decode_seqs + self.t_per_prefill_token * prefill_tokens


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = option(64, "most sequences in one step, as the engine's --max-num-seqs")
    max_num_batched_tokens: int = option(1024, "token budget of one step, as the engine's --max-num-batched-tokens")
    max_num_prefills: int = option(4, "most prompts prefilled in one step, as the engine's --max-num-prefills")
    cache_blocks: int = option(512, "blocks each replica's prefix cache holds (LRU)")

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_num_prefills) < 1 or self.cache_blocks < 0:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens and max_num_prefills must be positive, cache_blocks not negative"
            )


@dataclass(eq=False)
class Flight:
    """One request's progress through the proxy, the router and a replica. Times are simulated seconds."""

    arrival: Arrival
    replica: str | None = None
    cached_tokens: int = 0
    prefill_left: int = 0
    first_token_s: float | None = None
    done_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival.arrival_s

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.arrival.arrival_s


class PrefixCache:
    """An LRU set of block hashes. A hash chains every block before it, so a hit on block k means blocks 0..k match."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: tuple[int, ...]) -> int:
        """How many leading blocks are cached; those are marked recently used."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hits += 1
        return hits

    def peek(self, hashes: tuple[int, ...]) -> int:
        """How many leading blocks are cached, as `match` counts them, leaving the LRU order alone (what a router
        that knows the replicas' caches reads)."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        return hits

    def recent(self, limit: int) -> list[int]:
        """Up to `limit` hashes, the most recently used first."""
        return list(itertools.islice(reversed(self._blocks), limit))

    def insert(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Replica:
    def __init__(self, name: str, limits: EngineLimits, times: ServiceTimes, block_size: int) -> None:
        self.name = name
        self.limits = limits
        self.times = times
        self.block_size = block_size
        self.cache = PrefixCache(limits.cache_blocks)
        self.waiting: deque[Flight] = deque()
        self.prefilling: list[Flight] = []
        # a heap of (step count at which it ends, index, flight): decodes need no per-step work, only a count
        self.decoding: list[tuple[int, int, Flight]] = []
        self.steps = 0
        self.busy_s = 0.0  # seconds stepping
        self.work_s = 0.0  # seconds stepping, as a full batch would spend them: 1 per second at the ceiling
        self.stepping = False
        self._chunks: list[tuple[Flight, int]] = []  # the step in progress: prefill tokens given to each flight

    @property
    def planned(self) -> list[tuple[Flight, int]]:
        """The step in progress (between start_step and finish_step): each prompt given prefill, and how much."""
        return self._chunks

    @property
    def load(self) -> int:
        """Requests in flight here: what the router balances."""
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens taken but not yet computed, as the engine counts them (EngineCore.prefill_backlog): those of
        each waiting prompt past what the cache holds of it now, and the rest of the prompts part-way."""
        waiting = sum(
            f.arrival.uncached_tokens(self.cache.peek(f.arrival.block_hashes), self.block_size) for f in self.waiting
        )
        return waiting + sum(f.prefill_left for f in self.prefilling)

    def add(self, flight: Flight) -> None:
        flight.replica = self.name
        self.waiting.append(flight)

    def start_step(self) -> float | None:
        """Plan the next step and return how long it takes; None (and the replica idles) when there is no work."""
        budget = self.limits.max_num_batched_tokens - len(self.decoding)
        self._chunks = []
        for flight in self.prefilling:
            budget -= self._give(flight, budget)
        while (
            self.waiting
            and budget > 0
            and len(self.decoding) + len(self.prefilling) < self.limits.max_num_seqs
            and len(self.prefilling) < self.limits.max_num_prefills
        ):
            flight = self.waiting.popleft()
            self._admit(flight)
            budget -= self._give(flight, budget)
        self.stepping = bool(self._chunks or self.decoding)
        if not self.stepping:
            return None
        duration = self.times.step_s(len(self.decoding), sum(take for _, take in self._chunks))
        self.busy_s += duration
        # a step of few rows is busy but far from full: count its fixed cost only in the share a full batch would
        rows = len(self.decoding) + len(self._chunks)
        self.work_s += duration - self.times.t_fixed * (1 - rows / self.limits.max_num_seqs)
        return duration

    def finish_step(self, now: float) -> list[Flight]:
        """Apply the step that ends at `now`; the flights it finished."""
        self.steps += 1
        done: list[Flight] = []
        for flight, take in self._chunks:
            flight.prefill_left -= take
            if flight.prefill_left == 0:
                self._first_token(flight, now, done)
        while self.decoding and self.decoding[0][0] <= self.steps:
            flight = heapq.heappop(self.decoding)[2]
            flight.done_s = now
            done.append(flight)
        return done

    def drop(self, gone: set[Flight]) -> None:
        """Take these flights out wherever they are (between steps: the callers of a real-time replica that left)."""
        self.waiting = deque(flight for flight in self.waiting if flight not in gone)
        self.prefilling = [flight for flight in self.prefilling if flight not in gone]
        self.decoding = [entry for entry in self.decoding if entry[2] not in gone]
        heapq.heapify(self.decoding)

    def _admit(self, flight: Flight) -> None:
        held = self.cache.match(flight.arrival.block_hashes)
        flight.cached_tokens = held * self.block_size
        flight.prefill_left = flight.arrival.uncached_tokens(held, self.block_size)
        self.prefilling.append(flight)

    def _give(self, flight: Flight, budget: int) -> int:
        take = min(flight.prefill_left, budget)
        if take > 0:
            self._chunks.append((flight, take))
        return take

    def _first_token(self, flight: Flight, now: float, done: list[Flight]) -> None:
        flight.first_token_s = now  # the step that ends the prefill samples the first output token
        self.prefilling.remove(flight)
        self.cache.insert(flight.arrival.block_hashes)
        if flight.arrival.output_tokens == 1:
            flight.done_s = now
            done.append(flight)
        else:
            heapq.heappush(self.decoding, (self.steps + flight.arrival.output_tokens - 1, flight.arrival.index, flight))
