"""What speculation costs a stream that drafts nothing, served beside streams that draft a lot.

python scripts/neighbour_slowdown.py                  # off and ngram, one server each, twice over
python scripts/neighbour_slowdown.py --rounds 1 --methods ngram

Three clients send the bench's edit prompts in a loop (greedy: most of each answer is in its prompt, so their drafts
are long and kept). A fourth sends `--requests` greedy requests one after another with a presence penalty, so its
text repeats nothing and it drafts almost nothing. Printed per server: the fourth's mean latency (128 tokens each)
and the three's aggregate tokens/s. Without speculation's per-row bound (engine/speculation.py plan) the fourth ran
each step at the pace of its neighbours' drafted rows (docs/decisions/0044-speculation-on-by-default.md).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tokenmill.bench.servers import ManagedServer, free_port, tokenmill_spec
from tokenmill.bench.workloads import workload

TOKENS = 128
EOS_BANNED = {"1": -100}  # the default model's EOS: every request runs to TOKENS


async def complete(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with client.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as response:
        response.raise_for_status()
        await response.json()
    return time.perf_counter() - started


async def drive(url: str, requests: int) -> tuple[list[float], float]:
    prompts = workload("edit").prompts
    done = False
    tokens = 0

    async with aiohttp.ClientSession() as client:
        async with client.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]

        async def neighbour(first: int) -> None:
            nonlocal tokens
            i = first
            while not done:
                body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": TOKENS, "temperature": 0}
                await complete(client, url, {**body, "logit_bias": EOS_BANNED})
                tokens += TOKENS
                i += 3

        async def quiet() -> list[float]:
            nonlocal done
            await asyncio.sleep(3.0)  # the neighbours' prompts are read and their streams drafting
            latencies = []
            for k in range(requests):
                prompt = f"Story number {k}: Once upon a time, in a village by the sea,"
                body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
                latencies.append(
                    await complete(client, url, {**body, "presence_penalty": 1.5, "logit_bias": EOS_BANNED})
                )
            done = True
            return latencies

        started = time.perf_counter()
        measured = asyncio.ensure_future(quiet())
        await asyncio.gather(measured, *(neighbour(w) for w in range(3)))
        return measured.result(), tokens / (time.perf_counter() - started)


def run_one(method: str, requests: int, log_dir: Path) -> None:
    server = ManagedServer(tokenmill_spec(free_port(), None, ["--speculative", method]), log_dir)
    server.start(timeout_s=300.0)
    try:
        latencies, neighbours = asyncio.run(drive(server.url, requests))
    finally:
        server.stop()
    each = ", ".join(f"{s:.2f}" for s in latencies)
    print(
        f"--speculative {method:5s}  quiet stream: mean {statistics.mean(latencies):.2f} s ({each})"
        f"  neighbours: {neighbours:.0f} tok/s",
        flush=True,
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["off", "ngram"], choices=["off", "ngram", "suffix"])
    parser.add_argument("--rounds", type=int, default=2, help="passes over the methods, one way then back")
    parser.add_argument("--requests", type=int, default=4, help="the quiet stream's requests, one after another")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as log_dir:
        for r in range(args.rounds):
            for method in args.methods if r % 2 == 0 else reversed(args.methods):
                run_one(method, args.requests, Path(log_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
