from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from tokenmill.cluster.sim.cli import main
from tokenmill.cluster.sim.cluster import Capacity, SimConfig, simulate
from tokenmill.cluster.sim.replica import EngineLimits, PrefixCache, ServiceTimes
from tokenmill.cluster.sim.trace import Workload, block_hashes, make_trace

# Small runs: 16 prompt groups whose prefixes (16 blocks each) do not all fit one replica's 128-block cache, behind a
# proxy fast enough that the replicas bind (the measured default's would from two replicas on).
SMALL = SimConfig(
    times=ServiceTimes(s_router=0.002),
    workload=Workload(groups=16),
    engine=EngineLimits(cache_blocks=128),
    requests_per_replica=150,
    max_requests=1200,
)


def test_affinity_raises_the_cache_hit_rate_when_prompts_share_prefixes() -> None:
    off, on = simulate(SMALL, 4, "two-choices"), simulate(SMALL, 4, "affinity")
    assert on.cached_fraction > off.cached_fraction + 0.15
    assert on.ttft_p50_s < off.ttft_p50_s  # cached blocks skip prefill
    assert off.unfinished == on.unfinished == 0


def test_one_replica_runs_the_same_with_and_without_affinity() -> None:
    off, on = simulate(SMALL, 1, "two-choices"), simulate(SMALL, 1, "affinity")
    assert replace(on, routing="two-choices", worst_over_bound=off.worst_over_bound) == off
    assert on.cached_fraction > 0.3  # the hot groups' prefixes stay cached on the one replica


def test_the_proxy_caps_throughput_and_more_replicas_do_not_raise_it() -> None:
    slow_proxy = replace(
        SMALL, times=replace(ServiceTimes(), s_router=0.05), rate=60.0, requests_per_replica=1200, max_requests=1200
    )
    capacity = Capacity.of(slow_proxy)
    assert capacity.proxy_rps == pytest.approx(20.0)
    assert capacity.binds(8, warm=False) == capacity.binds(16, warm=False) == "proxy"
    eight, sixteen = simulate(slow_proxy, 8, "affinity"), simulate(slow_proxy, 16, "affinity")
    for run in (eight, sixteen):
        assert run.completed_rps == pytest.approx(20.0, rel=0.05)
        assert run.proxy_util > 0.95
        assert run.replica_load < 0.5
    assert sixteen.completed_rps <= eight.completed_rps * 1.02


def test_a_saturated_replica_completes_what_the_capacity_model_says() -> None:
    # long enough that the batch's bursts of completions average out over the window
    no_cache = replace(SMALL, engine=EngineLimits(cache_blocks=0), load=1.5, requests_per_replica=1200)
    run = simulate(no_cache, 1, "two-choices")
    assert run.cached_fraction == 0
    assert run.completed_rps == pytest.approx(Capacity.of(no_cache).replica_rps_cold, rel=0.05)
    assert run.replica_load > 0.9


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    assert simulate(SMALL, 3, "affinity") == simulate(SMALL, 3, "affinity")
    assert simulate(replace(SMALL, seed=1), 3, "affinity") != simulate(SMALL, 3, "affinity")


@pytest.mark.parametrize(
    ("replicas", "routing"), [(1, "two-choices"), (4, "two-choices"), (4, "affinity"), (4, "prefix")]
)
def test_latency_percentiles_are_ordered(replicas: int, routing: str) -> None:
    run = simulate(SMALL, replicas, routing)
    assert 0 < run.ttft_p50_s <= run.ttft_p99_s
    assert 0 < run.e2e_p50_s <= run.e2e_p99_s
    assert run.ttft_p50_s <= run.e2e_p50_s and run.ttft_p99_s <= run.e2e_p99_s  # each first token precedes its last


def test_bounded_loads_spill_a_hot_prefix_over_replicas() -> None:
    one_prefix = replace(SMALL, workload=Workload(groups=1), load=0.9)  # every prompt has the same affinity key
    bounded = simulate(one_prefix, 4, "affinity")
    assert bounded.worst_over_bound <= 0  # load after placing <= ceil(1.25 x (in flight + 1) / replicas)
    assert max(bounded.routed.values()) < 0.5 * sum(bounded.routed.values())
    assert min(bounded.routed.values()) > 0
    unbounded = simulate(replace(one_prefix, load_factor=1000.0), 4, "affinity")
    assert sorted(unbounded.routed.values()) == [0, 0, 0, sum(unbounded.routed.values())]


def test_a_run_stops_at_its_simulated_time_bound() -> None:
    run = simulate(replace(SMALL, max_sim_s=5.0), 2, "two-choices")
    assert run.unfinished > 0


def test_block_hashes_chain_the_prefix_and_leave_out_the_last_token() -> None:
    shared = list(range(32))
    a, b = block_hashes(shared + [100, 101], 16), block_hashes(shared + [200], 16)
    assert a[:2] == b[:2] and len(a) == len(b) == 2
    assert block_hashes(shared, 16) == a[:1]  # 32 tokens: the second block holds the last token, computed anyway
    assert block_hashes([9, *shared[1:], 100], 16)[1] != a[1]  # a block's hash depends on every block before it


def test_prefix_cache_matches_leading_blocks_and_evicts_the_least_recent() -> None:
    cache = PrefixCache(capacity_blocks=3)
    cache.insert((1, 2))
    assert cache.match((1, 2, 3)) == 2 and cache.match((5, 2)) == 0  # a miss ends the match
    cache.insert((7,))
    cache.match((1,))  # 1 is now the most recent, 2 the least
    cache.insert((8,))
    assert cache.match((2,)) == 0 and cache.match((1,)) == cache.match((7,)) == cache.match((8,)) == 1


def test_the_command_line_prints_the_capacity_model_and_each_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replicas", "1", "2", "--requests-per-replica", "30", "--s-router", "0.01", "--groups", "8"]) == 0
    out = capsys.readouterr().out
    assert "proxy 10 ms/request" in out and "binds cold/warm" in out
    runs = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"]) and len(line.split()) > 10]
    assert [(r[0], r[1]) for r in runs] == [
        ("1", "two-choices"),
        ("1", "affinity"),
        ("2", "two-choices"),
        ("2", "affinity"),
    ]


def test_the_command_line_runs_multi_round_users_with_each_routing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--replicas", "2", "--requests-per-replica", "20", "--conversations", "--rounds", "2"]
    assert main([*argv, "--routing", "round-robin", "prefix"]) == 0
    out = capsys.readouterr().out
    assert "users of 2 rounds" in out
    runs = [line.split() for line in out.splitlines() if line.split()[:1] == ["2"] and len(line.split()) > 10]
    assert [r[1] for r in runs] == ["round-robin", "prefix"]


def test_multi_round_users_grow_their_own_histories_over_one_system_prompt() -> None:
    workload = Workload(conversations=True, rounds=3, prefix_tokens=64, history_tokens=32, think_s=2.0)
    trace = make_trace(workload, rate=3.0, count=60, seed=0)
    by_user: dict[int, list[tuple[int, ...]]] = {}
    for arrival in trace:
        by_user.setdefault(arrival.group, []).append(arrival.block_hashes)
    system = trace[0].block_hashes[:4]  # 64 tokens: four whole blocks every prompt starts with
    assert all(a.block_hashes[:4] == system for a in trace)
    for rounds in by_user.values():
        assert len(rounds) <= 3
        for earlier, later in itertools.pairwise(rounds):
            assert later[: len(earlier)] == earlier and len(later) > len(earlier)  # the same prefix, and more
    assert len({a.key for a in trace}) == 1  # one affinity key: the first block is the system prompt's


def test_prefix_routing_keeps_a_users_rounds_where_its_history_is_cached() -> None:
    """Multi-round QA at 8 replicas: every prompt's first block is the shared system prompt, so affinity's key sends
    all to one ring position (spread only by the load bound), and round robin scatters each user's rounds; routing by
    the longest cached prefix keeps a user on the replica holding its history."""
    workload = Workload(
        conversations=True, rounds=5, prefix_tokens=256, history_tokens=512, think_s=3.0, output_min=16, output_max=48
    )
    cfg = SimConfig(workload=workload, engine=EngineLimits(cache_blocks=2048), rate=3.0, requests_per_replica=150)
    runs = {routing: simulate(cfg, 8, routing) for routing in ("round-robin", "affinity", "prefix")}
    assert runs["prefix"].cached_fraction > runs["round-robin"].cached_fraction + 0.3
    assert runs["prefix"].cached_fraction > runs["affinity"].cached_fraction
    assert runs["prefix"].ttft_p50_s < 0.6 * runs["round-robin"].ttft_p50_s
    assert all(run.unfinished == 0 for run in runs.values())


def test_same_replica_counts_how_often_a_users_next_round_follows_its_last() -> None:
    workload = Workload(
        conversations=True, rounds=5, prefix_tokens=256, history_tokens=512, think_s=3.0, output_min=16, output_max=48
    )
    cfg = SimConfig(workload=workload, engine=EngineLimits(cache_blocks=2048), rate=3.0, requests_per_replica=150)
    prefix, robin = simulate(cfg, 8, "prefix"), simulate(cfg, 8, "round-robin")
    assert prefix.same_replica >= 0.9  # the bar for same prefix → same replica
    assert robin.same_replica < 0.3  # in turn over 8: a user's next round lands on the same one by chance
    assert simulate(cfg, 1, "two-choices").same_replica == 1.0
