"""PrefixAffinityRouter's choices, on Ray Serve's own router machinery with stand-in replicas (no Ray cluster)."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from tokenmill.cluster import router as router_module
from tokenmill.cluster.router import PrefixAffinityRouter

DEPLOYMENT = DeploymentID("engine", "tokenmill")
SHARED = list(range(200, 216))  # one whole block


def replicas(n: int) -> list[Any]:
    return [SimpleNamespace(replica_id=ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(n)]


def pending(ids: list[int]) -> Any:
    return SimpleNamespace(
        args=["request-id", ids, None],
        routing_context=SimpleNamespace(should_backoff=False),
        metadata=SimpleNamespace(internal_request_id=uuid.uuid4().hex),
    )


def choose(router: PrefixAffinityRouter, candidates: list[Any], request: Any, accept: bool = True) -> list[list[str]]:
    """The ranks the router offers; with `accept`, its first replica then takes the request, as Ray reports it."""
    ranks = asyncio.run(router.choose_replicas(candidates, request))
    if accept and ranks:
        router.on_request_routed(request, ranks[0][0].replica_id, None)
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def make_router(**kwargs: Any) -> PrefixAffinityRouter:
    async def build() -> PrefixAffinityRouter:  # Ray's router wants a running event loop
        router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(**kwargs)
        return router

    return asyncio.run(build())


def test_prompts_sharing_a_first_block_are_ranked_alike() -> None:
    router, four = make_router(block_size=16), replicas(4)
    first = choose(router, four, pending(SHARED + [1, 2, 3]))
    assert [len(rank) for rank in first] == [1, 1, 1, 1]  # one replica a rank: the first that accepts takes it
    assert sorted(r for (r,) in first) == ["r0", "r1", "r2", "r3"]
    for tail in ([9], [4, 5, 6, 7], list(range(40))):
        assert choose(router, four, pending(SHARED + tail)) == first
    others = {choose(router, four, pending([i, *SHARED[1:]]))[0][0] for i in range(40)}
    assert len(others) > 1  # different first blocks go to different replicas


def test_a_replica_over_the_load_bound_is_passed_over() -> None:
    router, four = make_router(block_size=16), replicas(4)
    favourite = choose(router, four, pending(SHARED))[0][0]
    favoured = next(r for r in four if r.replica_id.unique_id == favourite)
    router.replica_queue_len_cache.update(favoured.replica_id, 12)  # bound: max(ceil(1.25 x 13 / 4), 8) = 8
    ranked = choose(router, four, pending(SHARED))
    assert ranked[0][0] != favourite and [favourite] in ranked


def test_a_prompt_without_a_whole_block_goes_by_two_choices() -> None:
    router, four = make_router(block_size=16), replicas(4)
    request = pending(SHARED[:10])
    ranks = choose(router, four, request)
    assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(ranks[0])) == 2
    assert request.routing_context.should_backoff  # else Ray's router retries at once, in a tight loop


def test_affinity_off_is_two_choices_for_every_prompt() -> None:
    router = make_router(block_size=16, affinity=False)
    assert all(len(choose(router, replicas(4), pending(SHARED))[0]) == 2 for _ in range(5))


def test_calls_without_prompt_ids_are_routed_too() -> None:
    router = make_router()
    assert len(choose(router, replicas(3), SimpleNamespace(args=[], routing_context=SimpleNamespace()))[0]) == 2
    assert choose(router, [], pending(SHARED)) == []


def held(ids: list[int], blocks: int, salt: str | None = None, adapter: str | None = None) -> list[int]:
    """What a replica holding the first `blocks` blocks of `ids` reports (EngineReplica.record_routing_stats)."""
    from tokenmill.engine.kv_cache import PrefixHashes

    chain = PrefixHashes(salt, adapter)
    return [int.from_bytes(chain.block(i, ids, 16)[:8], "little") for i in range(blocks)]


def test_a_replica_holding_more_of_the_prompt_comes_first_whatever_the_ring_says() -> None:
    """Every conversation starts with the same system prompt (one first block, one ring position); the replica that
    reported holding the user's history takes its next round."""
    router, four = make_router(block_size=16), replicas(4)
    history = SHARED + list(range(500, 564))  # the system prompt's block, then four of the user's own
    prompt = history + [7, 8, 9]
    ring_first = choose(router, four, pending(prompt))[0][0]
    holder = next(r for r in four if r.replica_id.unique_id != ring_first)
    other = next(r for r in four if r.replica_id.unique_id not in (ring_first, holder.replica_id.unique_id))
    holder.routing_stats = {"prefix_blocks": held(history, 5)}
    other.routing_stats = {"prefix_blocks": held(history, 1)}  # the system prompt only
    ranked = choose(router, four, pending(prompt))
    assert ranked[0] == [holder.replica_id.unique_id]
    assert sorted(r for (r,) in ranked) == ["r0", "r1", "r2", "r3"]  # the rest after it


def test_a_long_first_round_goes_where_the_fewest_prompt_tokens_wait() -> None:
    """Every user's first round shares only the system prompt (here 1 block of 5): the replica holding it has a queue
    of uncached histories to prefill, so the prompt goes to the one with the least prefill ahead of it."""
    router, four = make_router(block_size=16), replicas(4)
    prompt = SHARED + list(range(600, 664)) + [7, 8, 9]
    for replica, backlog in zip(four, (3000, 2000, 0, 100), strict=True):
        replica.routing_stats = {"prefix_blocks": held(prompt, 1 if backlog else 0), "prefill_backlog": backlog}
    assert [r for (r,) in choose(router, four, pending(prompt))] == ["r2", "r3", "r1", "r0"]


def test_a_history_holder_wins_unless_its_queue_is_longer_than_recomputing_the_history() -> None:
    router, two = make_router(block_size=16), replicas(2)
    history = SHARED + list(range(500, 564))  # 80 tokens, 5 blocks
    prompt = history + [7, 8, 9]
    two[0].routing_stats = {"prefix_blocks": held(history, 5), "prefill_backlog": 60}  # 60 + 3 to prefill
    two[1].routing_stats = {"prefix_blocks": [], "prefill_backlog": 0}  # 83
    assert choose(router, two, pending(prompt))[0] == ["r0"]
    two[0].routing_stats = {"prefix_blocks": held(history, 5), "prefill_backlog": 90}  # 93
    assert choose(router, two, pending(prompt))[0] == ["r1"]


def test_prompt_tokens_sent_since_a_report_count_until_the_next() -> None:
    router, two = make_router(block_size=16), replicas(2)
    for replica in two:
        replica.routing_stats = {"prefix_blocks": [], "prefill_backlog": 0}
    prompts = [SHARED + list(range(100 * i, 100 * i + 200)) for i in range(4)]  # 216 tokens, none held
    firsts = [choose(router, two, pending(p))[0][0] for p in prompts]
    assert firsts[0] != firsts[1] and firsts[2:] == firsts[:2]  # each sent prompt weighs on its replica in turn
    assert choose(router, two, pending(prompts[0]))[0][0] == firsts[0]  # both 432 tokens behind: the ring's first
    busy = next(r for r in two if r.replica_id.unique_id == firsts[1])
    busy.routing_stats = {"prefix_blocks": [], "prefill_backlog": 1000}  # a new report: what was sent is in it
    assert choose(router, two, pending(prompts[1]))[0][0] == firsts[0]  # 648 tokens behind against 1,000


def test_held_blocks_count_only_under_the_load_bound_and_with_the_same_salt() -> None:
    router, four = make_router(block_size=16), replicas(4)
    history = SHARED + list(range(500, 564))
    ring = choose(router, four, pending(history + [1]))
    holder = next(r for r in four if r.replica_id.unique_id != ring[0][0])
    holder.routing_stats = {"prefix_blocks": held(history, 5, salt="tenant-a")}
    assert choose(router, four, pending(history + [1])) == ring  # its blocks were made under another salt
    salted = SimpleNamespace(
        args=["id", history + [1], SimpleNamespace(cache_salt="tenant-a")],
        routing_context=SimpleNamespace(should_backoff=False),
    )
    assert choose(router, four, salted)[0] == [holder.replica_id.unique_id]
    router.replica_queue_len_cache.update(holder.replica_id, 12)  # over the bound: the ring decides again
    assert choose(router, four, salted)[0] != [holder.replica_id.unique_id]


def test_a_lora_requests_blocks_are_found_under_its_adapters_digest_on_the_replicas_that_load_it() -> None:
    four = replicas(4)
    history = SHARED + list(range(500, 564))
    prompt = history + [7, 8, 9]

    def first_for(adapter: str | None) -> list[str]:  # a fresh router each time: no placement of the last counts
        request = SimpleNamespace(
            args=["id", prompt, SimpleNamespace(cache_salt=None, adapter=adapter)],
            routing_context=SimpleNamespace(should_backoff=False),
        )
        return choose(make_router(block_size=16), four, request, accept=False)[0]

    ring_first = first_for("sql")
    holder, plain, elsewhere = (r for r in four if [r.replica_id.unique_id] != ring_first)
    holder.routing_stats = {"prefix_blocks": held(history, 5, adapter="d-sql"), "adapter_digests": {"sql": "d-sql"}}
    plain.routing_stats = {"prefix_blocks": held(history, 5), "adapter_digests": {}}  # the prompt without adapter
    elsewhere.routing_stats = {"prefix_blocks": held(history, 5, adapter="d-sql")}  # reports no such adapter
    assert first_for("sql") == [holder.replica_id.unique_id]
    assert first_for(None) == [plain.replica_id.unique_id]
    assert first_for("chat") == ring_first  # held by none: the ring decides


def test_a_burst_placed_before_any_request_is_sent_still_spreads_by_the_load_bound() -> None:
    """Ray ranks a burst of requests before any reaches a replica, so its queue lengths say 0 for all of them: the
    router counts its own placements not yet accepted, and the ninth request of one prefix spills off the ring."""
    router, four = make_router(block_size=16), replicas(4)
    burst = [pending(SHARED + [i]) for i in range(9)]
    firsts = [choose(router, four, request, accept=False)[0][0] for request in burst]
    assert len(set(firsts[:8])) == 1 and firsts[8] != firsts[0]  # free load 8, then the bound
    router.on_request_routed(burst[0], four[0].replica_id, None)  # accepted: Ray's cache counts it from here
    assert choose(router, four, burst[0], accept=False)[0][0] == firsts[0]  # ranked again: not counted against itself


def test_a_burst_of_first_rounds_goes_to_the_least_loaded_in_turn() -> None:
    router, two = make_router(block_size=16), replicas(2)
    prompts = [SHARED + list(range(600 + 70 * i, 664 + 70 * i)) + [7] for i in range(6)]
    two[0].routing_stats = {"prefix_blocks": held(prompts[0], 1)}  # the shared start only: nobody wins by holding
    firsts = [choose(router, two, pending(prompt), accept=False)[0][0] for prompt in prompts]
    assert sorted(firsts) == ["r0", "r0", "r0", "r1", "r1", "r1"]


def test_a_placement_never_confirmed_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    router, four = make_router(block_size=16), replicas(4)
    firsts = [choose(router, four, pending(SHARED + [i]), accept=False)[0][0] for i in range(8)]
    monkeypatch.setattr(router_module, "PLACING_TIMEOUT_S", 0.0)
    assert choose(router, four, pending(SHARED + [9]), accept=False)[0][0] == firsts[0]  # the eight no longer count


def test_a_prompt_after_another_that_ended_meets_its_blocks_before_any_report_says_so() -> None:
    """One client's prompts one after another, sharing a new first block: the first ended before the next report,
    so neither its tokens nor its blocks are known; the ring, not its ended backlog, decides the second."""
    router, two = make_router(block_size=16), replicas(2)
    for replica in two:
        replica.routing_stats = {"prefix_blocks": [], "prefill_backlog": 0}
    first, second = pending(SHARED + list(range(300, 340))), pending(SHARED + list(range(400, 440)))
    chosen = choose(router, two, first)[0][0]
    taker = next(r for r in two if r.replica_id.unique_id == chosen)
    router.on_request_completed(taker.replica_id, first.metadata.internal_request_id)
    assert choose(router, two, second)[0][0] == chosen
