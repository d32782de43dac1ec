"""Every request's time to first token in a level of the bench, sorted, against a running server.

python scripts/ttft_spread.py --url http://127.0.0.1:8000 [--concurrency 16] [--rounds 3]

`tokenmill bench` reports a level's TTFT p50 and p99; this prints each request's, so that where they fall can be seen:
a burst taken a few prompts a step comes out in groups, and the level's second wave of requests (each client's next,
sent as its first ends) falls between them. It drives the server with the bench's own requests (tokenmill/bench/load.py:
the same prompts, 128 tokens, EOS banned), a single stream first as the bench does, then `--rounds` passes of the level.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

import httpx

from tokenmill.bench import load
from tokenmill.bench.loopback import require_loopback
from tokenmill.bench.stats import RequestResult, summarize_level


async def spread(url: str, concurrency: int, rounds: int) -> None:
    settings = load.LoadSettings()
    async with load.make_client(settings) as client:
        model, served_eos = await load.discover(client, url)
        eos = served_eos or ()
        await load.run_single(client, url, model, settings, eos)
        for _ in range(rounds):
            start = time.perf_counter()
            results = await level(client, url, model, eos, settings, concurrency)
            summary = summarize_level(results, time.perf_counter() - start, concurrency)
            ttfts = sorted(r.ttft_s * 1e3 for r in results if r.ttft_s is not None)
            print(
                f"{concurrency} clients: {summary['agg_tok_s']:.1f} tok/s,"
                f" TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms;"
                f" each (ms): {' '.join(f'{t:.0f}' for t in ttfts)}"
            )


async def level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    eos: tuple[int, ...],
    settings: load.LoadSettings,
    concurrency: int,
) -> list[RequestResult]:
    """The level as load.run_level drives it, each request's result kept."""
    total, indices, results = settings.requests_for(concurrency), itertools.count(), []
    deadline = time.perf_counter() + settings.level_timeout_s

    async def client_loop() -> None:
        while time.perf_counter() < deadline and (i := next(indices)) < total:
            body = load.completion_body(model, load.PROMPTS[i % len(load.PROMPTS)], settings.max_tokens, eos)
            results.append(await load.stream_completion(client, url, body, settings.request_timeout_s))

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="a running server (127.0.0.1/::1/localhost only)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_loopback(args.url)
    asyncio.run(spread(args.url, args.concurrency, args.rounds))


if __name__ == "__main__":
    main()
