"""`tokenmill serve` as one process and behind Ray Serve replicas, on the same model, one system after another.

    python scripts/replica_bench.py                              # the packaged default model, all four systems
    python scripts/replica_bench.py --model PATH --systems one r2 r2-off --json figures.json

Per system: the router's cost (sequential one-token requests, p50/p90, and p50 minus one process's p50), the prefix
cache's hit rate on a workload of prompts that share per-group prefixes (cached over prompt tokens, from `usage`),
and decode throughput as `tokenmill bench` measures it (bench/load.py). Ray probes outward network addresses, so
the script re-runs itself under `unshare -n` (as root) where loopback is the only interface; everything it starts
or sends stays on 127.0.0.1, and every loop is bounded in count and time. Server logs go to .bench/replica-bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

from tokenmill.bench import load
from tokenmill.bench.load import LoadSettings, bench_url, discover, make_client
from tokenmill.bench.report import format_value, write_json
from tokenmill.bench.servers import ManagedServer, ServerStartError, cpu_cores, free_port, tokenmill_spec
from tokenmill.bench.stats import flat_figures, percentile

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {  # key → (label, serve flags)
    "one": ("one process", ()),
    "r1": ("replicas 1", ("--replicas", "1")),
    "r2": ("replicas 2", ("--replicas", "2")),
    "r2-off": ("replicas 2, affinity off", ("--replicas", "2", "--no-prefix-affinity")),
}
BASE = "one"
SENTENCES = (  # short, so a prefix's length can be tuned to the tokenizer a few tokens at a time
    *("Bees make honey in summer.", "Rivers carve deep valleys.", "Old maps show lost roads."),
    *("Cold rain falls on hills.", "Trains leave at dawn.", "Owls hunt mice at night."),
    *("Bread rises in warm rooms.", "Ships sail past the cape."),
)
TINY_PROMPT = "Hello there"  # under one KV block: it measures the hop, not prefill
START_TIMEOUT_S = 240  # Ray, Serve's proxy and every replica loading the model, on two busy cores
STOP_GRACE_S = 90
PHASE_TIMEOUT_S = 300  # no new request of a phase starts after this
WARMUP = 3
PREFIX_MAX_TOKENS = 8
MAX_REPEATS = 64
CPU_PARTS = {
    "proxy": "ProxyActor",
    "ingress": "ServeReplica:tokenmill:ingress",
    "engine": "tokenmill:engine",
    "other": "",
}
IDLE_S = 3.0  # how long the parts' idle CPU is sampled, to take it off the requests' figure
REEXEC_MARK = "TOKENMILL_REPLICA_BENCH_UNSHARED"


def ensure_private_network() -> None:
    """Re-run this script in a new network namespace with only loopback up, unless it already runs in one."""
    if [name for _, name in socket.if_nameindex()] == ["lo"]:
        return
    if os.environ.get(REEXEC_MARK):
        sys.exit("replica_bench: still not in a private network namespace after unshare -n")
    os.environ[REEXEC_MARK] = "1"
    script = 'ip link set lo up && exec "$@"'
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, *sys.argv])


# --- the pure parts: workload, arithmetic, table ----------------------------------------------------------------
def prefix_text(group: int, repeats: int) -> str:
    """The group's number first, so no two groups share a first KV block even where their sentences repeat."""
    return f"Topic {group}. " + " ".join([SENTENCES[group % len(SENTENCES)]] * repeats)


def build_workload(prefixes: Sequence[str], count: int, seed: int) -> list[tuple[int, str]]:
    """`count` (group, prompt) pairs, round-robin over the prefixes with a unique tail each, shuffled by `seed`."""
    prompts = [(i % len(prefixes), f"{prefixes[i % len(prefixes)]} Question {i}: what next?") for i in range(count)]
    random.Random(seed).shuffle(prompts)
    return prompts


def latency_figures(latencies: Sequence[float]) -> dict[str, float | None]:
    done = list(latencies)
    p50, p90 = (percentile(done, q) if done else None for q in (50, 90))
    return {"requests": len(done), "p50_s": p50, "p90_s": p90}


def prefix_figures(usages: Sequence[dict[str, Any]], failed: int, wall_s: float) -> dict[str, Any]:
    """Hit rate = cached prompt tokens over all prompt tokens, summed over the answered requests."""
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return {
        "requests": len(usages) + failed,
        "failed": failed,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "wall_s": wall_s,
        "req_s": len(usages) / wall_s if wall_s > 0 and usages else None,
    }


def overhead_s(results: dict[str, dict[str, Any]], key: str) -> float | None:
    """The system's p50 of one-token requests minus one process's: what the ingress and router add per request."""
    mine, base = (results.get(k, {}).get("overhead", {}).get("p50_s") for k in (key, BASE))
    return mine - base if mine is not None and base is not None else None


def columns(concurrency: Sequence[int]) -> list[tuple[str, str, str]]:
    """(header, figure, unit for report.format_value); figures are the keys of `flat_row`."""
    top = max(concurrency)
    cols = [("tiny p50 ms", "p50_s", "ms"), ("tiny p90 ms", "p90_s", "ms"), ("router +ms", "overhead_s", "ms")]
    cols += [(f"{part} CPU ms/req", f"cpu_ms_{part}", "") for part in CPU_PARTS]
    cols += [("hit", "hit_rate", "%"), ("prefix req/s", "req_s", ""), ("hit, k prompts", "batched_hit_rate", "%")]
    cols += [(f"{part} CPU ms/tok", f"token_cpu_ms_{part}", "") for part in ("proxy", "ingress")]
    cols += [("single tok/s", "decode_tok_s", "")]
    cols += [(f"c{c} tok/s", f"c{c}_agg_tok_s", "") for c in concurrency]
    return [*cols, (f"TTFT p50 ms c{top}", f"c{top}_ttft_p50_s", "ms")]


def flat_row(results: dict[str, dict[str, Any]], key: str) -> dict[str, float | None]:
    result = results[key]
    return {
        **result.get("overhead", {}),
        "overhead_s": overhead_s(results, key),
        **{k: result.get("prefix", {}).get(k) for k in ("hit_rate", "req_s")},
        "batched_hit_rate": result.get("batched", {}).get("hit_rate"),
        **result.get("decode", {}),
    }


def align(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def figures_table(results: dict[str, dict[str, Any]], concurrency: Sequence[int]) -> str:
    cols = columns(concurrency)
    body = [[results[k]["label"], *(format_value(flat_row(results, k).get(f), u) for _, f, u in cols)] for k in results]
    return align([["system", *(h for h, _, _ in cols)], *body])


def ratio_table(results: dict[str, dict[str, Any]], concurrency: Sequence[int]) -> str | None:
    """Each system's throughput over one process's (above 1: faster); None without a one-process row."""
    if BASE not in results:
        return None
    keys = ["decode_tok_s", *(f"c{c}_agg_tok_s" for c in concurrency)]
    base = flat_row(results, BASE)
    rows = [["vs one process", "single", *(f"c{c}" for c in concurrency)]]
    for key in results:
        mine = flat_row(results, key)
        rows.append([results[key]["label"], *(_ratio(mine.get(k), base.get(k)) for k in keys)])
    return align(rows)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "–"


# --- measuring one server ---------------------------------------------------------------------------------------
async def tiny_latencies(
    client: aiohttp.ClientSession, url: str, model: str, count: int, server_pid: int | None
) -> dict[str, float | None]:
    """Latencies of one-token requests, and the CPU each costs per part of the server (from its process tree)."""
    body = {"model": model, "prompt": TINY_PROMPT, "max_tokens": 1, "temperature": 0}
    latencies, deadline = [], time.perf_counter() + PHASE_TIMEOUT_S
    cpu_before: dict[str, float] = {}
    timed_from = time.perf_counter()
    for i in range(WARMUP + count):
        if time.perf_counter() > deadline:
            break
        if i == WARMUP:
            cpu_before = cpu_by_part(server_pid)
            timed_from = time.perf_counter()
        start = time.perf_counter()
        async with client.post(f"{url}/v1/completions", json=body) as response:
            ok = response.status == 200
            await response.read()
        if ok and i >= WARMUP:
            latencies.append(time.perf_counter() - start)
    used = await cpu_beyond_idle(server_pid, cpu_before, time.perf_counter() - timed_from)
    n = len(latencies)
    per_request = {f"cpu_ms_{part}": 1e3 * seconds / n for part, seconds in used.items() if n}
    return {**latency_figures(latencies), **per_request}


async def cpu_beyond_idle(pid: int | None, before: dict[str, float], elapsed_s: float) -> dict[str, float]:
    """CPU seconds each part used since `before` (`elapsed_s` ago), less what it burns idle over that time (Ray's
    polling loops), measured right after over IDLE_S with no request in flight."""
    after = cpu_by_part(pid)
    await asyncio.sleep(IDLE_S)
    idle = cpu_by_part(pid)
    return {
        part: after[part] - before.get(part, 0.0) - (idle[part] - after[part]) / IDLE_S * elapsed_s for part in after
    }


def cpu_by_part(pid: int | None) -> dict[str, float]:
    """CPU seconds used so far by the server's processes, by part: Serve's proxy, the ingress, the engine replicas,
    and the rest (the server's own process: all of it for one process; Ray's GCS, raylet and driver otherwise)."""
    parts = dict.fromkeys(CPU_PARTS, 0.0)
    if pid is None:
        return parts
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return parts
    for process in processes:
        try:
            name = " ".join(process.cmdline()) or process.name()
            times = process.cpu_times()
        except psutil.Error:
            continue
        part = next((p for p, mark in CPU_PARTS.items() if mark and mark in name), "other")
        parts[part] += times.user + times.system
    return parts


async def sized_prefixes(
    client: aiohttp.ClientSession, url: str, groups: int, tokens: int, first: int = 0
) -> list[str]:
    """Each group's prefix with its sentence repeated until /tokenize counts at least `tokens` tokens."""
    prefixes = []
    for group in range(first, first + groups):
        for repeats in range(1, MAX_REPEATS + 1):
            text = prefix_text(group, repeats)
            async with client.post(f"{url}/tokenize", json={"prompt": text}) as response:
                response.raise_for_status()
                if (await response.json())["count"] >= tokens:
                    break
        prefixes.append(text)
    return prefixes


async def prefix_workload(
    client: aiohttp.ClientSession, url: str, model: str, requests: list[list[str]], clients: int
) -> dict[str, Any]:
    """Each request's prompts in one completion (`usage` adds them up), from `clients` concurrent clients."""
    usages: list[dict[str, Any]] = []
    failed, queue, deadline = 0, iter(requests), time.perf_counter() + PHASE_TIMEOUT_S

    async def client_loop() -> None:
        nonlocal failed
        while time.perf_counter() < deadline and (item := next(queue, None)) is not None:
            body = {"model": model, "prompt": item, "max_tokens": PREFIX_MAX_TOKENS, "temperature": 0}
            async with client.post(f"{url}/v1/completions", json=body) as response:
                if response.status == 200:
                    usages.append((await response.json())["usage"])
                else:
                    failed += 1

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return prefix_figures(usages, failed, time.perf_counter() - start)


async def measure(url: str, args: argparse.Namespace, server_pid: int | None) -> dict[str, Any]:
    settings = LoadSettings(max_tokens=args.max_tokens, concurrency=tuple(args.concurrency))
    async with make_client(dataclasses.replace(settings, concurrency=(args.prefix_clients,))) as client:
        model, _ = await discover(client, url)
        overhead = await tiny_latencies(client, url, model, args.requests_overhead, server_pid)
        prefixes = await sized_prefixes(client, url, args.groups, args.prefix_tokens)
        prompts = [[prompt] for _, prompt in build_workload(prefixes, args.prompts, args.seed)]
        prefix = await prefix_workload(client, url, model, prompts, args.prefix_clients)
        # the same again on groups of their own (caches cold for them), several prompts to a request
        others = await sized_prefixes(client, url, args.groups, args.prefix_tokens, first=args.groups)
        flat = [prompt for _, prompt in build_workload(others, args.prompts, args.seed + 1)]
        k = args.prompts_per_request
        batched = await prefix_workload(client, url, model, [flat[i : i + k] for i in range(0, len(flat), k)], 1)
    cpu_before, start = cpu_by_part(server_pid), time.perf_counter()
    decode = await bench_url(url, settings)  # last: the workload meets cold prefix caches
    used = await cpu_beyond_idle(server_pid, cpu_before, time.perf_counter() - start)
    figures = flat_figures(decode["single"], decode["levels"])
    tokens = sum(level["completion_tokens"] for level in decode["levels"]) + sum(decode["single"]["completion_tokens"])
    for part, seconds in used.items():  # each streamed token's CPU per part
        figures[f"token_cpu_ms_{part}"] = 1e3 * seconds / tokens if tokens else None
    return {"overhead": overhead, "prefix": prefix, "batched": batched, "decode": figures}


# --- one system after another -----------------------------------------------------------------------------------
def wait_ok(url: str, timeout_s: float) -> None:
    """/health answers 200 while replicas are still starting ("degraded"); wait for "ok"."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"{url}/health").json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
    raise ServerStartError(f"{url}/health did not say ok within {timeout_s:.0f} s")


class TermStoppedServer(ManagedServer):
    """Stopped with SIGTERM, the gentle path of both shapes (ManagedServer's SIGINT makes the single-process server
    exit through a KeyboardInterrupt), then its session killed: Ray's processes can outlive the server's."""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        process, pid = self._process, self.pid
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass  # the base class's stop kills the session
        super().stop(grace_s=5.0)
        try:
            if pid is not None:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_system(key: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    label, flags = SYSTEMS[key]
    spec = tokenmill_spec(free_port(), args.model, list(flags))
    env = {"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    server = TermStoppedServer(dataclasses.replace(spec, name=f"tokenmill-{key}", env=env), log_dir)
    print(f"{label}: starting (log {server.log_path})", flush=True)
    try:
        start_s = server.start(START_TIMEOUT_S)
        wait_ok(server.url, START_TIMEOUT_S)
        return {"label": label, "start_s": start_s, **load.run(measure(server.url, args, server.pid))}
    except (ServerStartError, aiohttp.ClientError) as exc:
        print(f"{label}: failed: {exc}\n{server.log_tail()}", file=sys.stderr)
        return {"label": label, "error": str(exc)}
    finally:
        server.stop()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model path; default: the packaged default model")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--requests-overhead", type=int, default=40, help="sequential one-token requests")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the prefix workload")
    parser.add_argument("--groups", type=int, default=8, help="prefix groups of the workload")
    parser.add_argument("--prefix-tokens", type=int, default=64, help="least tokens of each group's prefix")
    parser.add_argument("--prefix-clients", type=int, default=4, help="concurrent clients of the workload")
    parser.add_argument("--seed", type=int, default=0, help="the workload's shuffle")
    parser.add_argument(
        "--prompts-per-request", type=int, default=4, help="prompts of one request in the several-prompts workload"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="decode levels")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    ensure_private_network()
    command = shlex.join([sys.executable, *sys.argv])
    log_dir = ROOT / ".bench" / "replica-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = {key: run_system(key, args, log_dir) for key in args.systems}
    print(f"\n{cpu_cores()} cores; {args.prompts} prompts in {args.groups} groups, {args.max_tokens} decode tokens")
    print(figures_table(results, args.concurrency))
    if ratios := ratio_table(results, args.concurrency):
        print(f"\n{ratios}")
    print(f"\n{command}")
    if args.json:
        write_json(args.json, {"command": command, "settings": vars(args), "systems": results})
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
