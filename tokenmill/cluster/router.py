"""PrefixAffinityRouter: Ray Serve's request router for the engine replicas, routing prompts by their first KV block.

Ray Serve asks a deployment handle's router which replica takes each call (`choose_replicas`); this one reads the
prompt's token ids from the call's arguments (EngineReplica.generate(request_id, prompt_token_ids, params)) and
ranks the replicas by consistent hashing with bounded loads (cluster/affinity.py). Each rank holds one replica, so
Ray sends the request to the first that accepts it; a replica that refuses (its queue full) or is gone passes it to
the next on the ring. Loads are the requests in flight that this router has sent to each replica, from Ray's own
queue-length cache (probed when it has nothing), plus the requests this router has placed but Ray has not yet sent:
a burst of requests is ranked before any of them reaches a replica, and without counting them every one of the burst
would see the same loads and go to the same replica. A call without ids, or a prompt shorter than one block, goes by
power of two choices, as Ray's default router does.

Where replicas report the prefix blocks they hold and the prompt tokens they have yet to prefill
(EngineReplica.record_routing_stats, every app.py's ROUTING_STATS_PERIOD_S: Ray Serve's routing stats), the replicas
under the load bound go first by the prompt tokens each would prefill before this prompt's first token: its backlog,
plus the tokens of the requests this router has sent it since its report that are still running, plus the part of
the prompt it does not hold (affinity.soonest_first). So a conversation's next round goes where its history is,
though every prompt starts with the same system prompt and so the same first block, unless the queue there is longer
than recomputing the history elsewhere. The prompt's blocks are keyed as the engine keys them (engine/kv_cache.py:
SHA-256 chains from the request's cache_salt and, for a request naming a LoRA adapter, the digest of that adapter's
weights, which each replica reports beside its blocks), the first 8 bytes of each. A replica that has not reported
the named adapter holds none of its blocks. The reports are up to a period old: a block cached since is found at the
next.

The router lives in the process of the handle's owner: the ingress, which sends every request, so its loads are
the whole story on one ingress replica.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence

from ray.serve._private.common import ReplicaID
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenmill.cluster.affinity import (
    DEFAULT_LOAD_FACTOR,
    HashRing,
    bounded_order,
    prefix_key,
    soonest_first,
    two_choices,
)
from tokenmill.engine.kv_cache import PrefixHashes

PROMPT_ARG = 1  # EngineReplica.generate's positional argument that holds the prompt's token ids
PARAMS_ARG = 2  # ... and its SamplingParams (the cache_salt and adapter its blocks' keys start from)
HELD_BLOCKS = "prefix_blocks"  # the routing stats' entry: the first 8 bytes of each held block's key, as an int
PREFILL_BACKLOG = "prefill_backlog"  # ... and the prompt tokens the replica has yet to prefill (its engine's count)
ADAPTER_DIGESTS = "adapter_digests"  # ... and each loaded LoRA adapter's name -> the digest its keys chain from
MAX_PROMPT_BLOCKS = 512  # leading blocks of a prompt looked up (8,192 tokens of 16)
# A placement Ray has not confirmed (on_request_routed) within this long is forgotten: the request was cancelled,
# or it is still waiting for room and will be ranked again, which places it afresh.
PLACING_TIMEOUT_S = 5.0


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(  # type: ignore[override]  # Ray passes request_router_kwargs as these keywords
        self, block_size: int = 16, load_factor: float = DEFAULT_LOAD_FACTOR, affinity: bool = True
    ) -> None:
        self.block_size = block_size
        self.load_factor = load_factor
        self.affinity = affinity
        self._ring = HashRing(())
        self._rng = random.Random()
        self._held: dict[str, tuple[object, frozenset[int]]] = {}  # replica → (its stats' list, as a set)
        # replica → (its last report's list, {request id: [its uncached prompt tokens]} of requests sent since that
        # are still running): what the replica's next report will count in its backlog
        self._sent: dict[str, tuple[object, dict[str, list[int]]]] = {}
        # id(request) → (the request, kept so its id is not reused; its first choice; when it was placed; the prompt
        # tokens each replica would compute for it, {} before any report)
        self._placing: dict[int, tuple[PendingRequest, str, float, dict[str, int]]] = {}

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
        placing, placing_tokens = self._not_yet_sent(pending_request)
        loads = {rid: self._in_flight(r) + placing[rid] for rid, r in by_id.items()}
        uncached = self._uncached(pending_request, by_id)
        if uncached:  # the replicas report what they hold and their backlogs
            backlog = {rid: self._backlog(rid, r) + placing_tokens[rid] + uncached[rid] for rid, r in by_id.items()}
            ranked = soonest_first(self._ring.order(key), backlog, loads, self.load_factor)
        else:
            ranked = bounded_order(self._ring.order(key), loads, self.load_factor)
        if pending_request is not None and ranked:
            self._placing[id(pending_request)] = (pending_request, ranked[0], time.monotonic(), uncached)
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        """A replica accepted the request: from now on Ray's queue-length cache counts it, and its prompt tokens
        weigh on the replica until it ends or the replica's next report counts them."""
        placed = self._placing.pop(id(pending_request), None)
        rid = replica_id.unique_id
        if placed is not None and rid in placed[3] and rid in self._sent:
            self._sent[rid][1].setdefault(_request_id(pending_request), []).append(placed[3][rid])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended: its prompt is no longer in the replica's backlog, whatever its last report said."""
        sent = self._sent.get(replica_id.unique_id)
        if sent is not None and (tokens := sent[1].get(internal_request_id)):
            tokens.pop()
            if not tokens:
                del sent[1][internal_request_id]

    def _not_yet_sent(self, pending: PendingRequest | None) -> tuple[Counter[str], Counter[str]]:
        """The requests placed but not yet accepted, other than `pending`'s own (ranked again after a refusal), by
        their first choice: how many, and their prompt tokens there. Placements older than PLACING_TIMEOUT_S are
        dropped."""
        now = time.monotonic()
        for stale in [key for key, (_, _, at, _) in self._placing.items() if now - at > PLACING_TIMEOUT_S]:
            del self._placing[stale]
        own = id(pending) if pending is not None else None
        counts: Counter[str] = Counter()
        tokens: Counter[str] = Counter()
        for key, (_, choice, _, uncached) in self._placing.items():
            if key != own:
                counts[choice] += 1
                tokens[choice] += uncached.get(choice, 0)
        return counts, tokens

    def _uncached(self, pending: PendingRequest | None, by_id: dict[str, RunningReplica]) -> dict[str, int]:
        """The prompt tokens each replica would compute for this prompt, by the leading blocks it reported holding;
        {} where no replica has reported yet."""
        if not any(_stats(r) for r in by_id.values()):
            return {}
        ids = _prompt_ids(pending)
        salt, adapter = _param(pending, "cache_salt"), _param(pending, "adapter")
        keys_by_digest: dict[str | None, list[int]] = {}  # replicas that loaded the same adapter key alike
        uncached = {}
        for rid, replica in by_id.items():
            digest = None if adapter is None else (_stats(replica).get(ADAPTER_DIGESTS) or {}).get(adapter)
            if adapter is not None and digest is None:  # not loaded there, as far as its report says: nothing held
                uncached[rid] = len(ids)
                continue
            if digest not in keys_by_digest:
                keys_by_digest[digest] = block_keys(ids, salt, self.block_size, adapter=digest)
            uncached[rid] = len(ids) - _leading(keys_by_digest[digest], self._held_set(rid, replica)) * self.block_size
        return uncached

    def _backlog(self, rid: str, replica: RunningReplica) -> int:
        """The prompt tokens the replica reported it has yet to prefill, and those of the requests this router has
        sent it since that are still running."""
        stats = _stats(replica)
        report = stats.get(HELD_BLOCKS)
        known = self._sent.get(rid)
        if known is None or known[0] is not report:  # a new report counts what was sent before it
            known = self._sent[rid] = (report, {})
        return int(stats.get(PREFILL_BACKLOG) or 0) + sum(sum(tokens) for tokens in known[1].values())

    def _held_set(self, rid: str, replica: RunningReplica) -> frozenset[int]:
        """The replica's last report as a set, made again only when a new report came."""
        reported = _stats(replica).get(HELD_BLOCKS) or ()
        known = self._held.get(rid)
        if known is None or known[0] is not reported:
            known = self._held[rid] = (reported, frozenset(reported))
        return known[1]

    def _in_flight(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if known is None else int(known)


def block_keys(
    ids: Sequence[int],
    salt: str | None,
    block_size: int,
    limit: int | None = MAX_PROMPT_BLOCKS,
    adapter: str | None = None,
) -> list[int]:
    """The first 8 bytes of the prefix-cache key of each whole block before the prompt's last token (the engine
    always computes that one), as an int, up to `limit` (None: all); `adapter`: the digest of the LoRA adapter's
    weights, for a request that names one."""
    count = (len(ids) - 1) // block_size if block_size > 0 else 0
    count = count if limit is None else min(count, limit)
    chain = PrefixHashes(salt, adapter)
    return [int.from_bytes(chain.block(i, ids, block_size)[:8], "little") for i in range(count)]


def _leading(keys: Sequence[int], held: frozenset[int]) -> int:
    """How many of the prompt's leading blocks a replica holds (a key chains every block before it)."""
    for n, key in enumerate(keys):
        if key not in held:
            return n
    return len(keys)


def _stats(replica: RunningReplica) -> dict:
    """The replica's last routing stats ({} before its first report)."""
    return getattr(replica, "routing_stats", None) or {}


def _request_id(pending: PendingRequest) -> str:
    """Ray's id of the request, as on_request_completed names it (the object's id for a stand-in without one)."""
    metadata = getattr(pending, "metadata", None)
    return str(getattr(metadata, "internal_request_id", id(pending)))


def _param(pending: PendingRequest | None, name: str) -> str | None:
    """A string field of the call's SamplingParams (cache_salt, adapter); None where it has none."""
    if pending is None or len(pending.args) <= PARAMS_ARG:
        return None
    value = getattr(pending.args[PARAMS_ARG], name, None)
    return value if isinstance(value, str) else None


def _prompt_ids(pending: PendingRequest | None) -> Sequence[int]:
    """The prompt's token ids, or () for a call that carries none (describe, a broadcast)."""
    if pending is None or len(pending.args) <= PROMPT_ARG:
        return ()
    ids = pending.args[PROMPT_ARG]
    return ids if isinstance(ids, list) else ()
