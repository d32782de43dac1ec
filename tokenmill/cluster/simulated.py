"""A simulated engine replica: EngineReplica's deployment API with no model behind it, for load tests of the ingress,
the router and the limits (`tokenmill serve --replicas 8 --simulate-engine`, docs/scaling.md).

Its engine schedules as the real one does, as the simulation models it (cluster/sim/replica.py: continuous batching
under a token budget, prefill chunks, a prefix cache of block keys) and runs each step in real time by sleeping what
the step would cost (sim's ServiceTimes, measured on the real engine). Asleep, a replica costs no CPU, so eight of them
share two cores with the ingresses and the proxy whose cost is what is measured. Its prefix cache holds the keys the
router computes for a prompt's blocks, and reports them as a real replica does, so routing by held blocks works.

What it does not simulate is the model: every prompt is answered with `max_tokens` copies of one token (no EOS, stop
strings, logprobs or grammars), in every one of its `n` sequences.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tokenmill.cluster.replica import REPORTED_BLOCKS, EngineReplica
from tokenmill.cluster.router import HELD_BLOCKS, PREFILL_BACKLOG, block_keys
from tokenmill.cluster.sim.replica import EngineLimits, Flight, Replica, ServiceTimes
from tokenmill.cluster.sim.trace import Arrival
from tokenmill.config import DEFAULT_MODEL_NAME, Config
from tokenmill.engine.core import EngineStats
from tokenmill.engine.outputs import FinishReason, RequestOutput, SequenceDelta, StepReport, chunk_complete, merged
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_tokenizer
from tokenmill.tokenizer import Tokenizer

CACHE_BLOCKS = 4096  # block keys a simulated replica's prefix cache holds (LRU)
DEFAULT_CONTEXT = 8192  # the context served, without --max-model-len
ANSWER = " the"  # the text of the one token every answer repeats


class SimulatedEngine:
    """The engine members EngineReplica uses, stepping a simulated Replica in real time on the event loop."""

    def __init__(self, config: Config, tokenizer: Tokenizer, times: ServiceTimes | None = None) -> None:
        limits = EngineLimits(config.max_num_seqs, config.max_num_batched_tokens, config.max_num_prefills, CACHE_BLOCKS)
        self.replica = Replica("simulated", limits, times or ServiceTimes(), config.block_size)
        self.block_size = config.block_size
        self.tokenizer = tokenizer
        path = config.model_path
        self.model_name = (
            config.served_model_name[0] if config.served_model_name else Path(path).stem if path else DEFAULT_MODEL_NAME
        )
        self.system_fingerprint = "fp_simulated"
        self.max_model_len = config.max_model_len or DEFAULT_CONTEXT
        self.stream_interval = config.stream_interval
        self.description = None
        self.token = (tokenizer.encode(ANSWER, add_special_tokens=False) or [0])[0]
        self.text = tokenizer.decode([self.token])
        self.counters = EngineStats()
        self._flights: dict[Flight, _Request] = {}
        self._cancelled: set[Flight] = set()
        self._numbers = itertools.count()
        self._observers: list[Callable[[StepReport], None]] = []
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    def stats(self) -> EngineStats:
        replica = self.replica
        self.counters.num_running = len(replica.prefilling) + len(replica.decoding)
        self.counters.num_waiting = len(replica.waiting)
        return self.counters

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        self._observers.append(observe)

    def held_keys(self, limit: int) -> list[int]:
        """The prefix cache's block keys, the most recently used first (what a real replica reports)."""
        return self.replica.cache.recent(limit)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        keys = block_keys(prompt_token_ids, params.cache_salt, self.block_size, limit=None)
        arrival = Arrival(
            next(self._numbers),
            time.monotonic(),
            0,
            len(prompt_token_ids),
            tuple(keys),
            None,
            max(params.max_tokens, 1),
        )
        flight = Flight(arrival)
        request = self._flights[flight] = _Request(request_id, prompt_token_ids, params.n)
        self.replica.add(flight)
        self._work.set()
        try:
            first = True
            while True:
                output = await request.outputs.get()
                while not (first or chunk_complete(output, self.stream_interval)):
                    output = merged(output, await request.outputs.get())
                first = False
                yield output
                if output.finished:
                    return
        finally:
            if self._flights.pop(flight, None) is not None:  # stopped before its end: the step loop drops it
                self._cancelled.add(flight)

    async def _run(self) -> None:
        replica = self.replica
        while True:
            self._drop_cancelled()
            duration = replica.start_step()
            if duration is None:
                self._work.clear()
                await self._work.wait()
                continue
            decoding = [flight for _, _, flight in replica.decoding]
            rows = len(decoding) + len(replica.prefilling)
            computed = len(decoding) + sum(take for _, take in replica.planned)
            await asyncio.sleep(duration)
            now = time.monotonic()
            done = set(replica.finish_step(now))
            started = [flight for flight, _ in replica.planned if flight.first_token_s == now]
            for flight in decoding + started:
                self._emit(flight, finished=flight in done)
            self._count(StepReport(duration, rows, computed))

    def _emit(self, flight: Flight, finished: bool) -> None:
        request = self._flights.get(flight)
        if request is None:
            return
        request.generated += 1
        reason = FinishReason.LENGTH if finished else None
        deltas = [
            SequenceDelta(j, self.text, [self.token], None, reason, num_tokens=request.generated)
            for j in range(request.n)
        ]
        cached = flight.cached_tokens if request.generated == 1 else 0
        request.outputs.put_nowait(
            RequestOutput(request.request_id, deltas, request.prompt, num_cached_tokens=cached, finished=finished)
        )
        if finished:
            self._flights.pop(flight, None)

    def _drop_cancelled(self) -> None:
        """Requests whose caller stopped listening leave the batch between two steps."""
        if self._cancelled:
            gone, self._cancelled = self._cancelled, set()
            self.replica.drop(gone)

    def _count(self, report: StepReport) -> None:
        counters = self.counters
        counters.steps += 1
        counters.tokens_computed += report.num_tokens
        counters.max_seqs_in_step = max(counters.max_seqs_in_step, report.num_seqs)
        counters.steps_with_multiple_seqs += report.num_seqs > 1
        for observe in self._observers:
            observe(report)


class _Request:
    def __init__(self, request_id: str, prompt: list[int], n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.n = n
        self.generated = 0
        self.outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()


class SimulatedReplica(EngineReplica):
    """The deployment class of `--simulate-engine`: an EngineReplica whose engine is a SimulatedEngine."""

    def load(self, config: Config) -> SimulatedEngine:  # type: ignore[override]  # the replica's engine, simulated
        measured = config.service_times()
        times = ServiceTimes(*measured) if measured is not None else None
        return SimulatedEngine(config, load_tokenizer(config), times)

    async def record_routing_stats(self) -> dict[str, Any]:
        engine: SimulatedEngine = self.engine  # type: ignore[assignment]
        return {HELD_BLOCKS: engine.held_keys(REPORTED_BLOCKS), PREFILL_BACKLOG: engine.replica.prefill_backlog}
