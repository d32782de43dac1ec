"""RemoteEngine: the ingress's view of one model's engine replicas, behind the Engine protocol the HTTP edge uses.

api/ runs unchanged on it: `generate` streams RequestOutputs from whichever replica the router (cluster/router.py)
picks, `stats()` adds up every replica's counters, step observers see every replica's steps. Those last two come
from the replicas' snapshots, fetched by `refresh` (the app awaits it before /stats, /metrics and /health answer),
so each scrape sees the cluster as it is then.

When a replica dies under a prompt: if the prompt had no output yet, it is sent once more, to another replica
(the dead one has left the router's set); otherwise its stream ends with an output marked `lost`, which the HTTP
edge turns into a 503 (an error frame on a stream that had started; a whole retry of a non-streamed completion,
which has sent nothing yet, see api/app.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import cast

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tokenmill.cluster.replica import ReplicaInfo, ReplicaSnapshot, summed
from tokenmill.engine.core import EngineStats
from tokenmill.engine.outputs import AdapterInfo, AdapterLoadError, EngineDescription, RequestOutput, StepReport
from tokenmill.engine.sampling import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)  # a replica's process died or cannot be reached
SNAPSHOT_TIMEOUT_S = 5.0  # a replica that does not answer a snapshot in time is counted as not running


class RemoteEngine:
    def __init__(self, handle: DeploymentHandle, info: ReplicaInfo, target_replicas: int) -> None:
        self._handle = handle
        self._stream = handle.options(stream=True)
        self.model_name = info.model_name
        self.system_fingerprint = info.system_fingerprint
        self.max_model_len = info.max_model_len
        self.description: EngineDescription | None = info.description
        self._tokenizer = info.tokenizer
        self.target_replicas = target_replicas  # below it /health says degraded
        self.snapshots: list[ReplicaSnapshot] = []  # the last refresh's, one per replica that answered
        self.refreshed = False
        self._refreshing: asyncio.Future[None] | None = None
        self._observers: list[Callable[[StepReport], None]] = []
        self.retries = 0  # prompts sent again after their replica died before answering
        self.steps_dropped = 0  # steps the replicas could not keep for a snapshot (unscraped for too long)

    @classmethod
    async def connect(cls, handle: DeploymentHandle, target_replicas: int) -> RemoteEngine:
        """Asks a replica what it serves (waiting for one to be up)."""
        info: ReplicaInfo = await handle.describe.remote()
        return cls(handle, info, target_replicas)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def running_replicas(self) -> int:
        return len(self.snapshots)

    async def start(self) -> None:
        """Nothing to start here: Ray Serve starts the replicas, each its own engine's step loop."""

    async def stop(self) -> None:
        """Nothing to stop here: the replicas stop with the deployment."""

    def is_healthy(self) -> bool:
        """At least one replica answered the last refresh (before the first: the one `connect` reached)."""
        return not self.refreshed or bool(self.snapshots)

    def stats(self) -> EngineStats:
        return summed([s.stats for s in self.snapshots])

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        self._observers.append(observe)

    async def refresh(self) -> None:
        """Every running replica's snapshot (the router's set: Ray's RUNNING replicas); their steps to the observers.
        Callers that arrive while a refresh is under way share it (a burst of /health probes costs one round)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._fetch())
        await asyncio.shield(self._refreshing)

    async def _fetch(self) -> None:
        results = await self._handle.broadcast("snapshot").results_async(
            timeout_s=SNAPSHOT_TIMEOUT_S, return_exceptions=True
        )
        self.snapshots = sorted((r for r in results if isinstance(r, ReplicaSnapshot)), key=lambda s: s.replica)
        self.refreshed = True
        for snapshot in self.snapshots:
            self.steps_dropped += snapshot.steps_dropped
            for report in snapshot.steps:
                for observe in self._observers:
                    observe(report)

    def health(self) -> dict[str, int]:
        return {"replicas": self.running_replicas, "target_replicas": self.target_replicas}

    def adapters(self) -> list[AdapterInfo]:
        """None: replicas serve the base model only (a start refuses --lora with --replicas)."""
        return []

    async def load_adapter(self, name: str, path: str) -> None:
        raise AdapterLoadError("LoRA adapters are not served with --replicas")

    async def unload_adapter(self, name: str) -> None:
        raise KeyError(name)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        for attempt in range(2):
            answered = False
            stream = self._call(request_id, prompt_token_ids, params)
            try:
                async for output in stream:
                    answered = True
                    yield output
                return
            except REPLICA_LOST as exc:
                if answered or attempt == 1:
                    yield _lost(request_id, prompt_token_ids, exc)
                    return
                self.retries += 1
                log.warning("request %s: its replica was lost before answering (%s); sending it again", request_id, exc)
            finally:
                stream.cancel()  # the consumer stopped early (client gone): the replica aborts the request

    def _call(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> DeploymentResponseGenerator:
        """generate() on the replica the router picks, as a call of its own. Inside an HTTP request a handle call
        inherits the request's internal id, and Ray's router matches a chosen replica to a waiting call by that id:
        two prompts of one request would share it and one would wait forever. So each gets a fresh one."""
        own = dataclasses.replace(serve_context._get_serve_request_context(), _internal_request_id=uuid.uuid4().hex)
        token = serve_context._serve_request_context.set(own)  # type: ignore[arg-type]  # Ray's var is typed None
        try:
            return cast(DeploymentResponseGenerator, self._stream.generate.remote(request_id, prompt_token_ids, params))
        finally:
            serve_context._serve_request_context.reset(token)


def _lost(request_id: str, prompt_token_ids: list[int], exc: BaseException) -> RequestOutput:
    reason = f"the replica serving it was lost ({type(exc).__name__})"
    return RequestOutput(request_id, [], list(prompt_token_ids), finished=True, error=reason, lost=True)
