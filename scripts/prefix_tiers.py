"""The prefix cache's tiers through real servers: a long shared prefix's time to first token, cold, from the live
cache, from the RAM tier and from the disk tier after a restart; and the prefix hit rate of a working set of
prefixes four times larger than the live KV cache, with tiers and without.

python scripts/prefix_tiers.py [--model FILE] [--prefix-tokens 4000] [--json docs/bench/]

Every prompt is token ids (random ids below `--vocab` from a fixed seed), sent with max_tokens 1, so a request's
time is its prefill: its time to first token. `--samples` servers start in turn on one disk-tier folder, each with a
live cache of `--live-tokens`. Each one but the first takes the prefix first, from disk (written by the one before);
then a prefix of the same length new to it (cold; the first server's own prefix too); the prefix again (from the
live cache); then, after two other prompts of its length have evicted it, the prefix once more (from RAM); then it
stops (SIGINT: what is queued for the disk tier is written first). Before each timed request the script waits until
the disk tier's writes have settled. Each figure is the median over the servers. The working set: prefixes of a
quarter of the live cache each, `--working-set-prefixes` of them, sent round after round in the same order (the order
an LRU cache does worst in), to a server with its RAM tier and to one with `--kv-cache-ram-gb 0`; the hit rate is
cached ÷ prompt tokens over the rounds after the first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.bandwidth import measure_read_gb_s
from tokenmill.bench.machine import describe_machine, machine_kind, slug, tokenmill_build
from tokenmill.bench.servers import ManagedServer, cpu_cores, free_port, tokenmill_spec

SUFFIX_TOKENS = 16  # a request's own tokens after the shared prefix
BLOCK = 16  # tokens per KV block (the server's default --block-size)


def ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(count)]


def prefill(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the answer of one token, prompt tokens the prefix cache gave)"""
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    usage = response.json()["usage"]
    return elapsed, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def server(args: argparse.Namespace, log_dir: Path, *extra: str) -> ManagedServer:
    argv = ["--num-kv-blocks", str(args.live_tokens // BLOCK), "--speculative", "off", *extra]
    managed = ManagedServer(tokenmill_spec(free_port(), args.model, argv), log_dir)
    managed.start(timeout_s=600)
    return managed


def settled(client: httpx.Client, url: str, timeout_s: float = 60.0) -> None:
    """Wait until the disk tier has written what was queued (its block count still for half a second), so that one
    figure's writes do not fall in the next figure's time."""
    last, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = client.get(f"{url}/stats").json()["kv_disk_blocks"]
        if now == last:
            return
        last = now
        time.sleep(0.5)


def timed(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, int]:
    settled(client, url)
    return prefill(client, url, prompt)


def restart_figures(args: argparse.Namespace, client: httpx.Client, log_dir: Path, vocab: int) -> dict[str, Any]:
    rng = random.Random(1)
    prefix = ids(rng, args.prefix_tokens, vocab)
    folder = tempfile.mkdtemp(prefix="tokenmill-kv-")
    samples: dict[str, list[tuple[float, int]]] = {"cold": [], "live": [], "ram": [], "disk": []}

    def asked() -> list[int]:
        return prefix + ids(rng, SUFFIX_TOKENS, vocab)

    for sample in range(args.samples):
        managed = server(args, log_dir, "--kv-cache-dir", folder)
        try:
            prefill(client, managed.url, ids(rng, 64, vocab))  # the first request's one-off costs out of the way
            if sample:
                samples["disk"].append(timed(client, managed.url, asked()))
            samples["cold"].append(timed(client, managed.url, ids(rng, args.prefix_tokens + SUFFIX_TOKENS, vocab)))
            if not sample:
                samples["cold"].append(timed(client, managed.url, asked()))
            samples["live"].append(timed(client, managed.url, asked()))
            for _ in range(2):  # two prompts of the prefix's length: the live cache holds 1.5 of them
                prefill(client, managed.url, ids(rng, args.prefix_tokens, vocab))
            samples["ram"].append(timed(client, managed.url, asked()))
        finally:
            managed.stop(grace_s=60)  # SIGINT: what is queued for the disk tier is written first
    return {
        name: {
            "ttft_s": statistics.median(t for t, _ in figures),
            "cached_tokens": min(c for _, c in figures),
            "samples": len(figures),
        }
        for name, figures in samples.items()
    }


def hit_rate(args: argparse.Namespace, client: httpx.Client, log_dir: Path, vocab: int, *extra: str) -> dict[str, Any]:
    rng = random.Random(2)
    each = args.live_tokens // 4
    prefixes = [ids(rng, each, vocab) for _ in range(args.working_set_prefixes)]
    managed = server(args, log_dir, *extra)
    prompt_tokens = cached_tokens = 0
    seconds = []
    try:
        for round_ in range(args.rounds):
            start = time.perf_counter()
            for prefix in prefixes:
                prompt = prefix + ids(rng, SUFFIX_TOKENS, vocab)
                _, cached = prefill(client, managed.url, prompt)
                if round_:
                    prompt_tokens, cached_tokens = prompt_tokens + len(prompt), cached_tokens + cached
            seconds.append(time.perf_counter() - start)
    finally:
        managed.stop(grace_s=60)
    return {
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "round_s": seconds,
        "working_set_tokens": each * len(prefixes),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file; default: the packaged model")
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--live-tokens", type=int, default=6000, help="the live KV cache's size, in tokens")
    parser.add_argument("--working-set-prefixes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=3, help="servers started in turn on one disk folder")
    parser.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    parser.add_argument("--json", type=Path, help="a folder (or file) to write the figures to")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-prefix-tiers-"))
    with httpx.Client(trust_env=False, timeout=600) as client:
        restart = restart_figures(args, client, log_dir, args.vocab)
        working = {}
        if args.working_set_prefixes:
            working["tiers"] = hit_rate(args, client, log_dir, args.vocab)
            working["no tiers"] = hit_rate(args, client, log_dir, args.vocab, "--kv-cache-ram-gb", "0")
    cold = restart["cold"]["ttft_s"]
    for name, figure in restart.items():
        print(
            f"{name:>5}: TTFT {figure['ttft_s'] * 1e3:8.1f} ms ({figure['ttft_s'] / cold:6.1%} of cold),"
            f" cached {figure['cached_tokens']} tokens, median of {figure['samples']}"
        )
    for name, result in working.items():
        rounds = ", ".join(f"{s:.1f}" for s in result["round_s"])
        print(
            f"working set of {result['working_set_tokens']} tokens, {name}: hit rate {result['hit_rate']:.1%};"
            f" rounds {rounds} s"
        )
    if args.json:
        write_json(args, restart, working)


def write_json(args: argparse.Namespace, restart: dict[str, Any], working: dict[str, Any]) -> None:
    machine = describe_machine(cpu_cores())
    machine["kind"] = machine_kind(machine)
    model = Path(args.model).name.removesuffix(".gguf") if args.model else "gemma-3-270m-q4-k-m"
    meta = {
        "command": " ".join(["python scripts/prefix_tiers.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine,
        "memory_read_gb_s": measure_read_gb_s(),
        "model": model,
        "tokenmill": tokenmill_build(),
        "peers": {},
        "prefix_tiers": {
            "prefix_tokens": args.prefix_tokens,
            "live_tokens": args.live_tokens,
            "rounds": args.rounds,
        },
    }
    results = {"meta": meta, "restart": restart, "working_set": working}
    path = args.json / f"{machine['kind']}--{slug(model)}--prefix-tiers.json" if args.json.is_dir() else args.json
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
