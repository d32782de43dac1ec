"""Every request's time to first token in a level of the bench, sorted, against a running server.

python scripts/ttft_spread.py --url http://127.0.0.1:8000 [--concurrency 16] [--rounds 3]

`tokenmill bench` reports a level's TTFT p50 and p99; this prints each request's, so that where they fall can be seen:
a burst taken a few prompts a step comes out in groups, and the level's second wave of requests (each client's next,
sent as its first ends) falls between them. It drives the server with the bench's own requests (tokenmill/bench/load.py:
the same prompts, 128 tokens, EOS banned), a single stream first as the bench does, then `--rounds` passes of the level.
"""

from __future__ import annotations

import argparse

from tokenmill.bench import load
from tokenmill.bench.loopback import require_loopback
from tokenmill.bench.stats import summarize_level


async def spread(url: str, concurrency: int, rounds: int) -> None:
    settings = load.LoadSettings()
    async with load.make_client(settings) as client:
        model, served_eos = await load.discover(client, url)
        eos = served_eos or ()
        await load.run_single(client, url, model, settings, eos)
        for _ in range(rounds):
            indexed, elapsed_s = await load.level_requests(client, url, model, settings, eos, concurrency)
            results = [result for _, result in indexed]
            summary = summarize_level(results, elapsed_s, concurrency)
            ttfts = sorted(r.ttft_s * 1e3 for r in results if r.ttft_s is not None)
            print(
                f"{concurrency} clients: {summary['agg_tok_s']:.1f} tok/s,"
                f" TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms;"
                f" each (ms): {' '.join(f'{t:.0f}' for t in ttfts)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="a running server (127.0.0.1/::1/localhost only)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_loopback(args.url)
    load.run(spread(args.url, args.concurrency, args.rounds))


if __name__ == "__main__":
    main()
