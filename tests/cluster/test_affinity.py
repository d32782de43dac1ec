"""Consistent hashing with bounded loads on a prompt's first KV block (tokenmill/cluster/affinity.py)."""

from __future__ import annotations

import random
from collections import Counter

from tokenmill.cluster.affinity import HashRing, bounded_order, load_bound, prefix_key, soonest_first, two_choices

REPLICAS = ["r0", "r1", "r2", "r3"]


def test_the_key_is_the_first_block_alone() -> None:
    first = list(range(100, 116))
    assert prefix_key(first[:15], 16) is None  # no whole block: nothing a cache could share
    assert prefix_key(first + [1, 2], 16) == prefix_key(first + [9, 9, 9], 16) == prefix_key(first, 16)
    assert prefix_key([7, *first[1:]], 16) != prefix_key(first, 16)
    assert prefix_key(first, 0) is None


def test_every_replica_appears_once_in_every_order() -> None:
    ring = HashRing(REPLICAS)
    rng = random.Random(0)
    for key in (rng.getrandbits(64) for _ in range(50)):
        assert sorted(ring.order(key)) == REPLICAS
    assert HashRing([]).order(123) == []


def test_keys_spread_evenly_over_the_replicas() -> None:
    ring = HashRing(REPLICAS)
    rng = random.Random(1)
    firsts = Counter(ring.order(rng.getrandbits(64))[0] for _ in range(4000))
    assert set(firsts) == set(REPLICAS)
    assert all(700 <= n <= 1300 for n in firsts.values()), firsts  # 1000 each, within a few per cent of even


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    rng = random.Random(2)
    keys = [rng.getrandbits(64) for _ in range(2000)]
    before, after = HashRing(REPLICAS), HashRing(["r0", "r1", "r3"])
    for key in keys:
        owner = before.order(key)[0]
        if owner != "r2":
            assert after.order(key)[0] == owner
        else:
            assert after.order(key)[0] == before.order(key)[1]  # its keys go to the next replica on the ring


def test_a_replica_at_the_load_bound_passes_the_prompt_on() -> None:
    order = ["r2", "r0", "r3", "r1"]
    assert bounded_order(order, {}) == order
    assert load_bound(total_load=8, replicas=4, free_load=0) == 3  # ceil(1.25 x 9 / 4)
    loads = {"r2": 3, "r0": 3, "r3": 1, "r1": 1}
    assert bounded_order(order, loads, free_load=0) == ["r3", "r2", "r0", "r1"]
    assert bounded_order(order, {"r2": 2, "r0": 3, "r3": 2, "r1": 1}, free_load=0) == order  # under it: it stays


def test_a_few_requests_in_flight_never_move_a_prefix() -> None:
    order = ["r1", "r0"]
    assert load_bound(total_load=3, replicas=2) == 8  # ceil(1.25 x 4 / 2) = 3, but a batching engine takes 8
    assert bounded_order(order, {"r1": 7, "r0": 0}) == order
    assert bounded_order(order, {"r1": 8, "r0": 0}) == ["r0", "r1"]


def test_a_hot_prefix_never_puts_more_than_the_bound_on_one_replica() -> None:
    ring, loads = HashRing(REPLICAS), dict.fromkeys(REPLICAS, 0)
    key = prefix_key(list(range(16)), 16)
    assert key is not None
    for _ in range(200):  # every request the same prefix, none finishing
        bound = load_bound(sum(loads.values()), len(loads), free_load=0)
        chosen = bounded_order(ring.order(key), loads, free_load=0)[0]
        loads[chosen] += 1
        assert loads[chosen] <= bound
    assert max(loads.values()) == load_bound(
        199, 4, free_load=0
    )  # the ring's first replicas fill to c x the mean, no further


def test_two_choices_are_two_different_replicas() -> None:
    rng = random.Random(3)
    for _ in range(20):
        pair = two_choices(REPLICAS, rng)
        assert len(pair) == 2 and len(set(pair)) == 2 and set(pair) <= set(REPLICAS)
    assert two_choices(["only"], rng) == ["only"]


def test_the_fewest_prompt_tokens_ahead_go_first_within_the_load_bound() -> None:
    order = ["a", "b", "c", "d"]
    backlog = {"a": 500, "b": 20, "c": 20, "d": 0}
    assert soonest_first(order, backlog, {"a": 0, "b": 3, "c": 1, "d": 0}) == ["d", "c", "b", "a"]
    assert soonest_first(order, backlog, {}) == ["d", "b", "c", "a"]  # ties go to the ring's order
    full = {"a": 0, "b": 0, "c": 0, "d": 12}  # bound: max(ceil(1.25 x 13 / 4), 8) = 8
    assert soonest_first(order, backlog, full) == ["b", "c", "a", "d"]  # over the bound: last, in ring order
