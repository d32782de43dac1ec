"""EngineReplica: one Ray Serve replica running one tokenmill engine (AsyncEngine) for one model.

Nothing here speaks HTTP: the ingress (cluster/app.py's Ingress) parses, tokenises and checks every request, then calls
`generate` through a deployment handle with the prompt's token ids, which is what the prefix-affinity router
(cluster/router.py) routes on. A replica is the single-process engine unchanged: its own KV cache and prefix cache,
its own worker thread, `config.threads` intra-op threads (the launcher gives each replica its share of the cores).

What the ingress reads of a replica besides its outputs comes from `snapshot`, called on every replica at once
(`handle.broadcast`): the engine's counters, the steps it ran since the last snapshot (so the ingress's /metrics
histograms see every replica's steps), and the process id, by which an operator (or a test) can find it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from tokenmill.api.logs import configure_logging
from tokenmill.cluster.router import ADAPTER_DIGESTS, HELD_BLOCKS, PREFILL_BACKLOG
from tokenmill.config import Config
from tokenmill.engine.core import EngineStats
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.outputs import EngineDescription, RequestOutput, StepReport
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.freeze import freeze_loaded_objects
from tokenmill.server.load import load_engine
from tokenmill.tokenizer import Tokenizer

MAX_UNREAD_STEPS = 65_536  # steps kept for the next snapshot; a replica nobody scrapes drops its oldest
REPORTED_BLOCKS = 16_384  # most prefix blocks a replica reports to the router (8 bytes each)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to serve a model it does not load: names, limits, and the tokenizer itself."""

    model_name: str
    system_fingerprint: str
    max_model_len: int
    tokenizer: Tokenizer
    description: EngineDescription | None


@dataclass
class ReplicaSnapshot:
    """One replica's state as `snapshot` reads it."""

    replica: str  # Ray Serve's id of the replica
    pid: int
    stats: EngineStats
    steps: list[StepReport] = field(default_factory=list)  # since the previous snapshot, oldest first
    steps_dropped: int = 0  # steps that did not fit in MAX_UNREAD_STEPS since the previous snapshot


class StepLog:
    """Step reports collected on the engine thread until the next snapshot takes them."""

    def __init__(self, limit: int = MAX_UNREAD_STEPS) -> None:
        self._lock = threading.Lock()
        self._steps: deque[StepReport] = deque(maxlen=limit)
        self._seen = 0

    def observe(self, report: StepReport) -> None:
        with self._lock:
            self._steps.append(report)
            self._seen += 1

    def take(self) -> tuple[list[StepReport], int]:
        """The unread steps, and how many were dropped for want of room."""
        with self._lock:
            steps, seen = list(self._steps), self._seen
            self._steps.clear()
            self._seen = 0
        return steps, seen - len(steps)


class EngineReplica:
    """The deployment class (cluster/app.py wraps it with serve.deployment and its options)."""

    async def __init__(self, config: Config) -> None:  # type: ignore[misc]  # Ray Serve awaits an async constructor
        configure_logging(config.log_level, config.log_format)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = self.load(config)
        self.steps = StepLog()
        self.engine.add_step_observer(self.steps.observe)
        await self.engine.start()

    def load(self, config: Config) -> AsyncEngine:
        engine = load_engine(config)
        freeze_loaded_objects()  # no full collection walks the loaded model's objects again
        return engine

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt; the caller cancelling the stream aborts the request."""
        async for output in self.engine.generate(request_id, prompt_token_ids, params):
            yield output

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing stats (every ROUTING_STATS_PERIOD_S): the prefix blocks this replica holds, the
        prompt tokens it has yet to prefill, and the digests its LoRA adapters' blocks are keyed from, for the router
        (cluster/router.py), read between two engine steps."""
        core = self.engine.core
        keys, backlog, adapters = await self.engine.between_steps(
            lambda: (core.blocks.held_keys(REPORTED_BLOCKS), core.prefill_backlog(), core.loaded_adapters())
        )
        return {
            HELD_BLOCKS: [int.from_bytes(key[:8], "little") for key in keys],
            PREFILL_BACKLOG: backlog,
            ADAPTER_DIGESTS: {adapter.name: adapter.digest for adapter in adapters},
        }

    def describe(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(
            engine.model_name,
            engine.system_fingerprint,
            engine.max_model_len,
            engine.tokenizer,
            engine.description,
        )

    def snapshot(self) -> ReplicaSnapshot:
        steps, dropped = self.steps.take()
        return ReplicaSnapshot(self.replica_id, os.getpid(), self.engine.stats(), steps, dropped)

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose step loop has died is replaced."""
        if not self.engine.is_healthy():
            raise RuntimeError("the engine's step loop is not running")

    async def __del__(self) -> None:
        await self.engine.stop()


def summed(stats: list[EngineStats]) -> EngineStats:
    """Every replica's counters added up (the largest batch is the largest any replica ran)."""
    total = EngineStats()
    for one in stats:
        for f in dataclasses.fields(EngineStats):
            mine, theirs = getattr(total, f.name), getattr(one, f.name)
            if f.name == "spec_responses":  # each replica's own finished choices
                setattr(total, f.name, mine + theirs)
                continue
            if isinstance(mine, list):  # counts per position: added position by position
                setattr(total, f.name, _added(mine, theirs))
                continue
            combine = max if f.name in ("max_seqs_in_step", "weight_bytes_per_token") else int.__add__
            setattr(total, f.name, combine(mine, theirs))
    return total


def _added(a: list[int], b: list[int]) -> list[int]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
