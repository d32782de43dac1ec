"""A single stream's decode speed after a long prompt, against running servers, side by side.

python scripts/long_context.py --url http://127.0.0.1:8000 --url http://127.0.0.1:8012 --tokens 2000 7000 --rounds 2

`tokenmill bench` measures a single stream after a short prompt, where attention is a small part of a step. Here each
request's prompt is a passage repeated to about `--tokens` tokens (counted by the server itself: a one-token probe
reads `usage.prompt_tokens`), with a different first line each round so no server can reuse a cached prefix, then 64
greedy tokens with EOS banned, streamed. It prints the prefill (time to the first token) and the decode speed after it
(tokens after the first ÷ the time from the first to the last), per server, in interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics

import aiohttp

from tokenmill.bench import load
from tokenmill.bench.loopback import require_loopback

PASSAGE = " ".join(load.PROMPTS) + "\n"
NEW_TOKENS = 64


async def prompt_tokens(client: aiohttp.ClientSession, url: str, model: str, text: str) -> int:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    async with client.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        return int((await response.json())["usage"]["prompt_tokens"])


async def measure(urls: list[str], targets: list[int], rounds: int) -> None:
    async with load.make_client(load.LoadSettings()) as client:
        found = [(url, *await load.discover(client, url)) for url in urls]
        # the EOS ids one server reports (tokenmill's /tokenizer_info) for all: they serve the same file
        eos = next((ids for _, _, ids in found if ids), ())
        servers = [(url, model, await prompt_tokens(client, url, model, PASSAGE * 10) / 10) for url, model, _ in found]
        for target in targets:
            rates: dict[str, list[float]] = {url: [] for url in urls}
            prefills: dict[str, list[float]] = {url: [] for url in urls}
            for r in range(rounds):
                for url, model, per_passage in servers:
                    text = f"Round {r} of {target}.\n" + PASSAGE * max(1, round(target / per_passage))
                    body = load.completion_body(model, text, NEW_TOKENS, eos)
                    result = await load.stream_completion(client, url, body, timeout_s=600)
                    if not result.ok or result.ttft_s is None or result.last_token_s is None:
                        raise SystemExit(f"{url}: {result.error or 'no tokens'}")
                    rates[url].append((result.completion_tokens - 1) / (result.last_token_s - result.ttft_s))
                    prefills[url].append(result.ttft_s)
            for url, model, _ in servers:
                print(
                    f"~{target} prompt tokens  {model} at {url}: decode "
                    f"{' / '.join(f'{v:.1f}' for v in rates[url])} tok/s (median {statistics.median(rates[url]):.1f}), "
                    f"prefill {' / '.join(f'{v:.2f}' for v in prefills[url])} s",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="a running server (127.0.0.1 only); repeat")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 7000], help="prompt lengths, about")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    load.run(measure([require_loopback(url) for url in args.url], args.tokens, args.rounds))


if __name__ == "__main__":
    main()
