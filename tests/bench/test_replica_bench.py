"""scripts/replica_bench.py's pure parts: the workload, the hit-rate and overhead arithmetic, the tables. No servers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench.scripts import load_script

rb = load_script("replica_bench")


def _result(label: str, p50: float, tok_s: float, hit: float | None = 0.5) -> dict[str, Any]:
    return {
        "label": label,
        "overhead": {"requests": 10, "p50_s": p50, "p90_s": p50 * 2},
        "prefix": {"hit_rate": hit, "req_s": 20.0},
        "decode": {"decode_tok_s": tok_s, "c1_agg_tok_s": tok_s, "c4_agg_tok_s": 2 * tok_s, "c4_ttft_p50_s": 0.1},
    }


def test_the_workload_has_every_group_sharing_its_prefix_with_unique_tails() -> None:
    prefixes = [rb.prefix_text(g, 3) for g in range(8)]
    prompts = rb.build_workload(prefixes, 64, seed=0)
    assert len(prompts) == 64 and len({text for _, text in prompts}) == 64
    assert sorted({group for group, _ in prompts}) == list(range(8))
    assert all(text.startswith(prefixes[group] + " ") for group, text in prompts)
    assert [group for group, _ in prompts[:8]] != list(range(8))  # shuffled, not round-robin


def test_the_workload_order_depends_on_the_seed_alone() -> None:
    prefixes = [rb.prefix_text(g, 2) for g in range(4)]
    assert rb.build_workload(prefixes, 32, seed=7) == rb.build_workload(prefixes, 32, seed=7)
    assert rb.build_workload(prefixes, 32, seed=7) != rb.build_workload(prefixes, 32, seed=8)


def test_group_prefixes_differ_from_their_first_words() -> None:
    # the group's number leads, so groups past the sentence list still differ in their first block
    starts = {rb.prefix_text(g, 4)[:10] for g in range(len(rb.SENTENCES) + 4)}
    assert len(starts) == len(rb.SENTENCES) + 4


def test_hit_rate_is_cached_over_prompt_tokens_summed_over_requests() -> None:
    usages = [
        {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}},
        {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}},
        {"prompt_tokens": 50, "prompt_tokens_details": None},  # a server that sends no details: nothing cached
    ]
    figures = rb.prefix_figures(usages, failed=1, wall_s=2.0)
    assert figures["hit_rate"] == pytest.approx(64 / 250)
    assert (figures["requests"], figures["req_s"]) == (4, 1.5)
    assert rb.prefix_figures([], failed=3, wall_s=1.0)["hit_rate"] is None


def test_latency_percentiles_and_overhead_against_one_process() -> None:
    figures = rb.latency_figures([0.010, 0.020, 0.030, 0.040, 0.050])
    assert (figures["p50_s"], figures["p90_s"]) == (pytest.approx(0.030), pytest.approx(0.046))
    results = {"one": _result("one process", 0.005, 100.0), "r2": _result("replicas 2", 0.025, 50.0)}
    assert rb.overhead_s(results, "r2") == pytest.approx(0.020)
    assert rb.overhead_s(results, "one") == 0
    assert rb.overhead_s({"r2": results["r2"]}, "r2") is None  # no one-process row to subtract
    assert rb.latency_figures([])["p50_s"] is None


def test_the_tables_align_one_row_per_system_and_ratios_over_one_process() -> None:
    results = {
        "one": _result("one process", 0.005, 100.0),
        "r2-off": _result("replicas 2, affinity off", 0.025, 50.0, hit=None),
        "r1": {"label": "replicas 1", "error": "did not start"},
    }
    table = rb.figures_table(results, [1, 4]).splitlines()
    assert table[0].split("  ")[0].strip() == "system" and "TTFT p50 ms c4" in table[0]
    assert len(table) == 5 and len({len(line.rstrip()) for line in table[:2]}) == 1
    cpu = ["–"] * 4  # no CPU figures in these results
    row = ["25", "50", "20", *cpu, "–", "20.0", "–", "–", "–", "50.0", "50.0", "100.0", "100"]
    assert table[3].split()[-16:] == row
    assert table[4].startswith("replicas 1") and set(table[4].split()[2:]) == {"–"}
    ratios = rb.ratio_table(results, [1, 4]).splitlines()
    assert ratios[3].split()[-3:] == ["0.50x", "0.50x", "0.50x"] and ratios[4].split()[-3:] == ["–", "–", "–"]
    assert rb.ratio_table({"r1": results["r1"]}, [1, 4]) is None
