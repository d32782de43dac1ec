"""PrefixAffinityRouter: Ray Serve's request router for the engine replicas, routing prompts by their first KV block.

Ray Serve asks a deployment handle's router which replica takes each call (`choose_replicas`); this one reads the
prompt's token ids from the call's arguments (EngineReplica.generate(request_id, prompt_token_ids, params)) and
ranks the replicas by consistent hashing with bounded loads (cluster/affinity.py). Each rank holds one replica, so
Ray sends the request to the first that accepts it; a replica that refuses (its queue full) or is gone passes it to
the next on the ring. Loads are the requests in flight that this router has sent to each replica, from Ray's own
queue-length cache (probed when it has nothing). A call without ids, or a prompt shorter than one block, goes by
power of two choices, as Ray's default router does.

The router lives in the process of the handle's owner: the ingress, which sends every request, so its loads are
the whole story on one ingress replica.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenmill.cluster.affinity import DEFAULT_LOAD_FACTOR, HashRing, bounded_order, prefix_key, two_choices

PROMPT_ARG = 1  # EngineReplica.generate's positional argument that holds the prompt's token ids


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(  # type: ignore[override]  # Ray passes request_router_kwargs as these keywords
        self, block_size: int = 16, load_factor: float = DEFAULT_LOAD_FACTOR, affinity: bool = True
    ) -> None:
        self.block_size = block_size
        self.load_factor = load_factor
        self.affinity = affinity
        self._ring = HashRing(())
        self._rng = random.Random()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # every rank offered is every replica: if none takes it, wait before again
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = prefix_key(_prompt_ids(pending_request), self.block_size) if self.affinity else None
        if key is None:
            return [[by_id[r] for r in two_choices(sorted(by_id), self._rng)]] if by_id else []
        if set(self._ring.replicas) != set(by_id):
            self._ring = HashRing(by_id)
        loads = {rid: self._in_flight(r) for rid, r in by_id.items()}
        return [[by_id[rid]] for rid in bounded_order(self._ring.order(key), loads, self.load_factor)]

    def _in_flight(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if known is None else int(known)


def _prompt_ids(pending: PendingRequest | None) -> Sequence[int]:
    """The prompt's token ids, or () for a call that carries none (describe, a broadcast)."""
    if pending is None or len(pending.args) <= PROMPT_ARG:
        return ()
    ids = pending.args[PROMPT_ARG]
    return ids if isinstance(ids, list) else ()
