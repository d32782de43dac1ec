"""`python -m tokenmill.cluster.sim`: where a cluster of replicas runs out — the replicas or the proxy.

Replays a synthetic trace (trace.py: Poisson arrivals, prompts sharing Zipf-popular prefixes) through a
proxy stage and the cluster router onto N simulated continuous-batching replicas (replica.py, whose
`ServiceTimes` hold the per-step costs to replace with measured ones), with prefix affinity off and on. It prints the
capacity model (one replica's ceiling from the service times, N of them, the proxy's ceiling and which binds) and, for
each run, the offered and completed rates, latency percentiles, the prefix cache's hit rate and each stage's
utilisation. Deterministic for a --seed; every run is bounded in requests and in simulated time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tokenmill.cluster.sim.cluster import ROUTINGS, Capacity, SimConfig, SimResult, simulate
from tokenmill.cluster.sim.replica import EngineLimits, ServiceTimes
from tokenmill.cluster.sim.trace import Workload

FLAG_GROUPS: tuple[tuple[str, Any], ...] = (
    ("service times (measured per replica and per proxy)", ServiceTimes),
    ("engine limits of each replica", EngineLimits),
    ("synthetic workload", Workload),
    ("the runs", SimConfig),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenmill.cluster.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 10, 100], help="replica counts to run")
    for title, cls in FLAG_GROUPS:
        group = p.add_argument_group(title)
        for f in fields(cls):
            if "help" not in f.metadata:  # the nested configs have their own groups
                continue
            flag, text = f"--{f.name.replace('_', '-')}", f"{f.metadata['help']} (default: {f.default})"
            if isinstance(f.default, bool):
                group.add_argument(flag, action="store_true", default=f.default, help=f.metadata["help"])
                continue
            kind = float if f.default is None else type(f.default)
            group.add_argument(flag, type=kind, default=f.default, help=text)
    p.add_argument(
        "--routing",
        nargs="+",
        choices=ROUTINGS,
        default=["two-choices", "affinity"],
        help="how the router picks a replica, each a run: two-choices (the less loaded of two), round-robin, affinity "
        "(the prefix key's ring), prefix (the replica caching the longest prefix, as cached-block reports allow); "
        "default: two-choices affinity",
    )
    return p


def config_from(args: argparse.Namespace) -> SimConfig:
    def build(cls: Any, **nested: Any) -> Any:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if "help" in f.metadata}, **nested)

    nested = {"times": build(ServiceTimes), "engine": build(EngineLimits), "workload": build(Workload)}
    config: SimConfig = build(SimConfig, **nested)
    return config


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def capacity_table(cfg: SimConfig, replica_counts: Sequence[int]) -> str:
    cap = Capacity.of(cfg)
    headers = ["replicas", "cold req/s", "cold tok/s", "warm req/s", "warm tok/s", "proxy req/s", "binds cold/warm"]
    rows = []
    for n in replica_counts:
        cold, warm = n * cap.replica_rps_cold, n * cap.replica_rps_warm
        rows.append(
            [str(n), f"{cold:.1f}", f"{cold * cap.output_tokens:.0f}", f"{warm:.1f}", f"{warm * cap.output_tokens:.0f}"]
            + [f"{cap.proxy_rps:.0f}", f"{cap.binds(n, warm=False)}/{cap.binds(n, warm=True)}"]
        )
    return format_table(headers, rows)


def result_row(cfg: SimConfig, r: SimResult) -> list[str]:
    def ms(s: float) -> str:
        return f"{s * 1000:.0f}"

    return [
        *(str(r.replicas), r.routing, str(cfg.requests(r.replicas))),
        *(f"{r.offered_rps:.1f}", f"{r.completed_rps:.1f}", f"{r.output_tok_s:.0f}"),
        *(ms(r.ttft_p50_s), ms(r.ttft_p99_s), ms(r.e2e_p50_s), ms(r.e2e_p99_s)),
        *(f"{r.cached_fraction:.0%}", f"{r.same_replica:.0%}", f"{r.proxy_util:.0%}", f"{r.replica_busy:.0%}"),
        f"{r.replica_load:.0%}",
        str(r.unfinished),
    ]


RESULT_HEADERS = [
    *("replicas", "routing", "requests", "offered/s", "done/s", "out tok/s"),
    *("TTFT p50", "p99 ms", "e2e p50", "p99 ms", "cached", "same", "proxy", "busy", "load", "unfinished"),
]


def describe(cfg: SimConfig, replica_counts: Sequence[int]) -> str:
    t, w = cfg.times, cfg.workload
    per_replica = ", ".join(f"{n}: {cfg.requests(n) / n:.0f}" for n in replica_counts)
    return (
        f"service times: step {t.t_fixed * 1000:g} ms + {t.t_per_seq * 1000:g} ms/seq + "
        f"{t.t_per_prefill_token * 1000:g} ms/prefill token; proxy {t.s_router * 1000:g} ms/request x {cfg.proxies}\n"
        + (
            f"workload: users of {w.rounds} rounds {w.think_s:g} s apart: a {w.prefix_tokens}-token system prompt, "
            f"{w.history_tokens} of their own, {w.suffix_min}-{w.suffix_max}-token questions, "
            if w.conversations
            else f"workload: {w.groups} prefix groups (zipf {w.zipf:g}) of {w.prefix_tokens} tokens + {w.suffix_min}-"
            f"{w.suffix_max} own, "
        )
        + f"{w.output_min}-{w.output_max} out; cache {cfg.engine.cache_blocks} blocks a replica\n"
        f"requests per replica (capped by --max-requests): {per_replica}; figures after the first {cfg.warmup:.0%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.replicas) < 1:
        parser.error(f"argument --replicas: must be at least 1, got {min(args.replicas)}")
    try:
        cfg = config_from(args)
    except ValueError as exc:  # the dataclasses' own checks, reported as a usage error
        parser.error(str(exc))
    print(describe(cfg, args.replicas))
    print("\ncapacity model (a full batch of each replica; cold: prefixes prefilled, warm: prefixes cached)")
    print(capacity_table(cfg, args.replicas))
    offered = "absolute" if cfg.rate is not None else f"{cfg.load:g} of the cold ceiling"
    print(f"\nsimulation (offered load {offered}; TTFT and e2e latency in ms)")
    print(
        "same: of the requests after their group's (user's) first, the share sent where the group's previous one went;"
        " proxy: its busy share; busy: the replicas' stepping share; load: their share of the full-batch ceiling"
    )
    rows = [result_row(cfg, simulate(cfg, n, routing)) for n in args.replicas for routing in args.routing]
    print(format_table(RESULT_HEADERS, rows))
    return 0
