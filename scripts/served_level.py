"""Where a served level of the bench spends its time: the server's steps, its threads, and the client beside it.

python scripts/served_level.py --url http://127.0.0.1:8000 [--pid SERVER_PID] [--rounds 3] [--concurrency 16]

It drives a running tokenmill server with the bench's own requests (tokenmill/bench/load.py: the same prompts, 128
tokens, EOS banned; a single stream first, as the bench does), then `--rounds` passes of the level, and prints for each:
- the aggregate tokens/s and the TTFT p50, as the bench reports them, and each request's TTFT by wave: the level's
  first `concurrency` requests arrive together, each client's next one as its first ends;
- the server's engine steps over the level and their mean duration (its /metrics), to set against the same step in
  process (scripts/engine_speed.py --batch 16 --bench-prompts): the difference is what serving costs a step;
- the CPU this process, the load generator, spent per streamed token: on a machine that also runs the server it is
  taken from the server's cores;
- with `--pid`, each server thread's CPU time and the time it was runnable but waiting for a core (Linux's
  /proc/PID/task/TID/schedstat): the engine's compute threads wait there while the event loop or the client runs.
"""

from __future__ import annotations

import argparse
import re
import resource
from pathlib import Path

import aiohttp

from tokenmill.bench import load
from tokenmill.bench.loopback import require_loopback
from tokenmill.bench.stats import summarize_level


def step_totals(metrics: str) -> tuple[float, float]:
    """(steps, seconds) of every model's engine steps so far, from a tokenmill server's /metrics text."""
    steps = seconds = 0.0
    for name, value in re.findall(r"^tokenmill_engine_step_seconds_(count|sum)\{[^}]*\} (\S+)$", metrics, re.MULTILINE):
        if name == "count":
            steps += float(value)
        else:
            seconds += float(value)
    return steps, seconds


def thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread of `pid`: (seconds on a CPU, seconds runnable but waiting for one), from schedstat."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns, wait_ns, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        times[int(task.name)] = (run_ns / 1e9, wait_ns / 1e9)
    return times


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def metrics_text(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(f"{url}/metrics") as response:
        response.raise_for_status()
        return await response.text()


async def run(url: str, pid: int | None, concurrency: int, rounds: int, api_key: str | None) -> None:
    settings = load.LoadSettings(api_key=api_key)
    async with load.make_client(settings) as client:
        model, served_eos = await load.discover(client, url)
        eos = served_eos or ()
        await load.run_single(client, url, model, settings, eos)
        for _ in range(rounds):
            steps0, seconds0 = step_totals(await metrics_text(client, url))
            threads0, cpu0 = thread_times(pid) if pid else {}, cpu_seconds()
            indexed, elapsed = await load.level_requests(client, url, model, settings, eos, concurrency)
            cpu1, threads1 = cpu_seconds(), thread_times(pid) if pid else {}
            steps1, seconds1 = step_totals(await metrics_text(client, url))
            results = [r for _, r in indexed]
            summary = summarize_level(results, elapsed, concurrency)
            tokens = sum(r.completion_tokens for r in results)
            steps = steps1 - steps0
            print(
                f"{concurrency} clients: {summary['agg_tok_s']:.1f} tok/s, TTFT p50 "
                f"{summary['ttft_p50_s'] * 1e3:.0f} ms; {steps:.0f} steps, mean "
                f"{(seconds1 - seconds0) / max(steps, 1) * 1e3:.2f} ms, {(seconds1 - seconds0) / elapsed:.0%} of the "
                f"level; the client {(cpu1 - cpu0) / max(tokens, 1) * 1e6:.0f} µs of CPU a token"
            )
            for wave in range(-(-len(indexed) // concurrency)):
                ttfts = sorted(r.ttft_s * 1e3 for i, r in indexed if i // concurrency == wave and r.ttft_s is not None)
                print(f"  wave {wave + 1} TTFT (ms): {' '.join(f'{t:.0f}' for t in ttfts)}")
            for tid, (run1, wait1) in sorted(threads1.items()):
                run0, wait0 = threads0.get(tid, (0.0, 0.0))
                if run1 - run0 >= 0.01 * elapsed:
                    print(f"  thread {tid}: on a CPU {run1 - run0:.2f} s, runnable but waiting {wait1 - wait0:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="a running tokenmill server (127.0.0.1/::1/localhost only)")
    parser.add_argument("--pid", type=int, help="the server's process id: its threads' CPU and run-queue times")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--api-key", help="the server's --api-key, where it has one")
    args = parser.parse_args()
    require_loopback(args.url)
    load.run(run(args.url, args.pid, args.concurrency, args.rounds, args.api_key))


if __name__ == "__main__":
    main()
