"""`tokenmill bench --workload edit|free|score`: speculative decoding side by side with none, on one workload.

tokenmill runs twice, with speculation (`--speculative`, ngram unless told) and without; with `--compare`, llama.cpp's
llama-server runs twice too, with its own lookup decoding (`--llama-lookup-args`) and without. Every system takes the
workload's prompts (workloads.py) as the standard run takes its own: the single stream over each prompt in turn, then
each concurrency level, round after round, in turn one way and then back (the machine's speed drifts by the minute, and
a drift then falls on every system alike). Each pass runs on a server started for it and stopped after it, alone on
the machine: two servers of one program started side by side ran the same 16-row steps 9% apart for as long as they
ran, the first started the slower, whichever it was (docs/decisions/0039-longer-drafts-and-grammar-drafts.md). The
two tokenmill servers must answer alike (greedy decoding is exact with speculation): the run compares their texts
request by request and reports how many matched, and reads the speculating server's acceptance from its /stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from tokenmill.bench import load
from tokenmill.bench.llama_server import ensure_llama_server, llama_server_spec
from tokenmill.bench.load import LoadSettings
from tokenmill.bench.report import progress
from tokenmill.bench.servers import ManagedServer, ServerSpec, free_port, tokenmill_spec
from tokenmill.bench.stats import larger
from tokenmill.bench.workloads import Workload

DEFAULT_CONCURRENCY = (16,)  # the single stream is always run; the issue of many clients is the 16-client level
SPEC_KEYS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")


def systems_for(args: argparse.Namespace, model_file: str | None, cache_dir: str | None) -> list[ServerSpec]:
    """The servers of a workload run, the speculating tokenmill first (the ratios divide its figures)."""
    extra = shlex.split(args.tokenmill_args)
    method = args.speculative
    specs = [
        _named(
            tokenmill_spec(free_port(), args.model, [*extra, "--speculative", method], cache_dir), f"tokenmill+{method}"
        ),
        tokenmill_spec(free_port(), args.model, [*extra, "--speculative", "off"], cache_dir),
    ]
    if args.compare:
        if model_file is None:
            raise ValueError("--compare needs a GGUF file for llama-server")
        binary = str(ensure_llama_server(args.llama_server_dir, args.llama_server_version))
        peer_extra = shlex.split(args.llama_server_args)
        lookup = [*peer_extra, *shlex.split(args.llama_lookup_args)]
        slots, ctx, threads = args.llama_server_slots, args.llama_server_ctx, args.peer_threads
        specs += [
            _named(
                llama_server_spec(binary, free_port(), model_file, threads, slots, ctx, lookup), "llama-server+lookup"
            ),
            llama_server_spec(binary, free_port(), model_file, threads, slots, ctx, peer_extra),
        ]
    return specs


def workload_settings(args: argparse.Namespace, settings: LoadSettings, chosen: Workload) -> LoadSettings:
    """The workload's prompts; every prompt once in the single stream unless --single-runs says otherwise; no
    prefill timings (the standard run has them)."""
    prompts = chosen.prompts
    single_runs = args.single_runs or len(prompts)
    concurrency = tuple(args.concurrency or DEFAULT_CONCURRENCY)
    return dataclasses.replace(
        settings, prompts=prompts, single_runs=single_runs, concurrency=concurrency, prefill_tokens=()
    )


def run_workload(args: argparse.Namespace, settings: LoadSettings, rounds: int, start_timeout: float) -> dict[str, Any]:
    """Run the rounds, each pass on a server started for it, and gather each pass, the acceptance and the answers'
    agreement."""
    specs = systems_for(args, args.model, args.cache_dir)
    systems: dict[str, dict[str, Any]] = {spec.name: {"passes": [], "peak_rss_mb": None} for spec in specs}
    drafts: list[dict[str, Any]] = []  # the speculating server's /stats after each of its passes
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        for spec, server in in_turn(
            specs, rounds, start_timeout, Path(tmp), systems, f" on the {args.workload} workload"
        ):
            if settings.eos_ids is None:
                settings = dataclasses.replace(settings, eos_ids=load.served_eos_ids(server.url, settings))
            systems[spec.name]["passes"].append(load.run(load.bench_url(server.url, settings)))
            if spec is specs[0]:
                drafts.append(load.run(_spec_stats(server.url, settings)))
    names = list(systems)
    return {
        "settings": settings,
        "systems": systems,
        "speculation": _summed_stats(drafts),
        "agreement": agreement(systems[names[0]]["passes"], systems[names[1]]["passes"]),
    }


def in_turn(
    specs: list[ServerSpec],
    rounds: int,
    start_timeout: float,
    log_dir: Path,
    systems: dict[str, dict[str, Any]],
    what: str = "",
) -> Iterator[tuple[ServerSpec, ManagedServer]]:
    """Each pass's system and its server, started for it and stopped once the caller is done with it, round after
    round in turn one way and then back (A B C D, D C B A: the machine's drift falls on all alike); each system's
    peak RSS kept in systems[name]["peak_rss_mb"]."""
    for r in range(rounds):
        for spec in specs if r % 2 == 0 else specs[::-1]:
            progress(f"round {r + 1}/{rounds}: {spec.name}{what}")
            if r == 0:  # each system's command, once
                progress(f"starting {spec.name}: {shlex.join(spec.argv)}")
            server = ManagedServer(spec, log_dir)
            try:
                server.start(start_timeout)
                yield spec, server
            finally:
                server.stop()
                systems[spec.name]["peak_rss_mb"] = larger(systems[spec.name]["peak_rss_mb"], server.peak_rss_mb)


def agreement(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> dict[str, int]:
    """Of the requests both systems answered in the same place of the same pass, how many had the same text."""
    compared = same = 0
    for a, b in zip(first, second):
        pairs = list(zip(a["single"]["digests"], b["single"]["digests"]))
        for level_a, level_b in zip(a["levels"], b["levels"]):
            pairs += zip(level_a["digests"], level_b["digests"])
        for x, y in pairs:
            if x is not None and y is not None:
                compared += 1
                same += x == y
    return {"compared": compared, "identical": same}


async def _spec_stats(url: str, settings: LoadSettings) -> dict[str, Any]:
    async with load.make_client(settings) as client:
        try:
            stats = await load.served_stats(client, url)
        except aiohttp.ClientError:
            stats = {}
    return {key: stats.get(key) for key in (*SPEC_KEYS, "spec_accepted_per_position")}


def _summed_stats(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The speculating server's drafts over all its passes (each pass's server counted from its start), and the
    share of draft tokens kept."""
    figures: dict[str, Any] = {}
    for key in SPEC_KEYS:
        counts = [p[key] for p in passes if p.get(key) is not None]
        figures[key] = sum(counts) if counts else None
    drafted, kept = figures["spec_draft_tokens"], figures["spec_accepted_tokens"]
    figures["acceptance"] = kept / drafted if drafted else None
    per_position: list[int] = []
    for p in passes:
        for i, n in enumerate(p.get("spec_accepted_per_position") or ()):
            per_position += [0] * (i + 1 - len(per_position))
            per_position[i] += n
    figures["accepted_per_position"] = per_position or None
    return figures


def _named(spec: ServerSpec, name: str) -> ServerSpec:
    return dataclasses.replace(spec, name=name)
