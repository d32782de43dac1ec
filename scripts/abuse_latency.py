"""Abuse against one server, and what everyone else sees meanwhile: each pattern's answer, /health's worst latency
while it runs, and a bystander's 2-token completions' worst latency.

    python scripts/abuse_latency.py                    # every pattern, a tiny random model it serves itself
    python scripts/abuse_latency.py --quick            # the same at 1/16 of the sizes (a check that it runs)
    python scripts/abuse_latency.py --model default    # the real Gemma 3 270M
    python scripts/abuse_latency.py --only header-128MiB --only text-30MB

Each pattern runs alone, in the order listed (the first structured-output request comes first, on a fresh server):
the abuse is sent while /health is polled every 50 ms and a bystander sends a 2-token completion, one after another.
A pattern's row: the abuse's HTTP status (or what ended it) and seconds, /health's worst latency and failures, and the
bystander's worst latency and count. The aim, on a quiet machine with the real model: /health within 1 s throughout,
the bystander within 2 s. The server listens on 127.0.0.1 only; every loop is bounded in count and in time
(--timeout-s a pattern). The rate-limited pattern uses a per-user token limit, which binds only the requests that
name that user.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.servers import ManagedServer, ServerSpec, free_port, tokenmill_spec

ROOT = Path(__file__).resolve().parent.parent
HEALTH_EVERY_S = 0.05
RATE_LIMITED_USER = "abuser"
USER_TOKEN_LIMIT = "20000/min"
MB = 1 << 20


@dataclass
class Row:
    name: str
    status: str = "-"
    abuse_s: float = 0.0
    health_max_s: float = 0.0
    health_failures: int = 0
    bystander_max_s: float = 0.0
    bystanders: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class Target:
    url: str
    model: str
    max_model_len: int
    vocab_size: int
    scale: float  # 1.0: the sizes as named; --quick: 1/16

    def size(self, full: int) -> int:
        return max(int(full * self.scale), 1)


Abuse = Callable[[httpx.AsyncClient, Target], Awaitable[str]]


# --- the patterns ---------------------------------------------------------------------------------------------------
async def post(client: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> str:
    response = await client.post(path, json=payload)
    return str(response.status_code)


def completion(target: Target, **fields: Any) -> dict[str, Any]:
    return {"model": target.model, "max_tokens": 2, **fields}


async def first_structured(client: httpx.AsyncClient, t: Target) -> str:
    return await post(client, "/v1/completions", completion(t, prompt="x", structured_outputs={"regex": "[ab]+"}))


async def text_30mb(client: httpx.AsyncClient, t: Target) -> str:
    return await post(client, "/v1/completions", completion(t, prompt="ab " * (t.size(30 * MB) // 3)))


async def prompts_2048(client: httpx.AsyncClient, t: Target) -> str:
    prompt = ["lorem ipsum dolor " * (t.size(15 << 10) // 18)] * 2048
    return await post(client, "/v1/completions", completion(t, prompt=prompt))


async def tokenize_16mb(client: httpx.AsyncClient, t: Target) -> str:
    return await post(client, "/tokenize", {"model": t.model, "prompt": "hello world " * (t.size(16 * MB) // 12)})


async def schema_enum_20mb(client: httpx.AsyncClient, t: Target) -> str:
    enum = [f"value-{i:012d}" for i in range(t.size(20 * MB) // 22)]
    return await post(client, "/v1/completions", completion(t, prompt="x", structured_outputs={"json": {"enum": enum}}))


async def header_128mib(client: httpx.AsyncClient, t: Target) -> str:
    """A header of 128 MiB, sent 64 KiB at a time until the server answers or closes."""
    host, port = t.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Big: ")
        piece = b"a" * (64 << 10)
        for _ in range(t.size(128 * MB) // len(piece)):
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:
                break
        try:
            answer = await asyncio.wait_for(reader.read(200), 30)
        except ConnectionError:  # closed with the header unread: the answer may be lost with the connection
            return "reset"
        return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
    finally:
        writer.close()


async def prompt_logprobs_n128(client: httpx.AsyncClient, t: Target) -> str:
    ids = [(7 * i) % t.vocab_size for i in range(min(1500, t.max_model_len - 1))]
    fields = {"n": 128, "echo": True, "logprobs": 5, "prompt_logprobs": 20, "max_tokens": 0}
    return await post(client, "/v1/completions", completion(t, prompt=ids, **fields))


async def choice_1024(client: httpx.AsyncClient, t: Target) -> str:
    choices = [f"{i:05d}" + "c" * t.size(30 << 10) for i in range(1024)]
    return await post(client, "/v1/completions", completion(t, prompt="x", structured_outputs={"choice": choices}))


async def any_of_3000(client: httpx.AsyncClient, t: Target) -> str:
    schema = {"anyOf": [{"type": "array", "items": {"type": "integer"}, "minItems": i} for i in range(3000)]}
    return await post(client, "/v1/completions", completion(t, prompt="x", structured_outputs={"json": schema}))


async def rate_limited_600kb(client: httpx.AsyncClient, t: Target) -> str:
    """20 prompts of 600 kB from a user whose token limit they are far past: each should cost the server nothing."""
    statuses: dict[str, int] = {}
    for _ in range(20):
        payload = completion(t, prompt="word " * (t.size(600 << 10) // 5), user=RATE_LIMITED_USER)
        status = await post(client, "/v1/completions", payload)
        statuses[status] = statuses.get(status, 0) + 1
    return " ".join(f"{count}x{status}" for status, count in sorted(statuses.items()))


async def ids_128x2000(client: httpx.AsyncClient, t: Target) -> str:
    ids = [(11 * i) % t.vocab_size for i in range(min(2000, t.max_model_len - 2))]
    return await post(client, "/v1/completions", completion(t, prompt=[ids] * 128, max_tokens=1))


async def allowed_1m_n64(client: httpx.AsyncClient, t: Target) -> str:
    allowed = [i % t.vocab_size for i in range(1 << 20)]
    return await post(client, "/v1/completions", completion(t, prompt="x", allowed_token_ids=allowed, n=64))


async def nested_regex_n128(client: httpx.AsyncClient, t: Target) -> str:
    payload = completion(t, prompt="x", n=128, max_tokens=8, structured_outputs={"regex": "(a{1,1000}){1,1000}"})
    return await post(client, "/v1/completions", payload)


PATTERNS: dict[str, Abuse] = {
    "first-structured": first_structured,
    "text-30MB": text_30mb,
    "2048-prompts-15KB": prompts_2048,
    "tokenize-16MB": tokenize_16mb,
    "schema-enum-20MB": schema_enum_20mb,
    "header-128MiB": header_128mib,
    "prompt-logprobs-n128": prompt_logprobs_n128,
    "choice-1024x30KB": choice_1024,
    "anyOf-3000": any_of_3000,
    "rate-limited-600KB": rate_limited_600kb,
    "fair-128x2000-ids": ids_128x2000,
    "fair-allowed-1M-n64": allowed_1m_n64,
    "fair-regex-n128": nested_regex_n128,
}


# --- measuring one pattern ------------------------------------------------------------------------------------------
async def watch_health(client: httpx.AsyncClient, row: Row, done: asyncio.Event, deadline: float) -> None:
    while not done.is_set() and time.monotonic() < deadline:
        start = time.monotonic()
        try:
            ok = (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        row.health_max_s = max(row.health_max_s, time.monotonic() - start)
        row.health_failures += not ok
        await asyncio.sleep(HEALTH_EVERY_S)


async def bystand(client: httpx.AsyncClient, target: Target, row: Row, done: asyncio.Event, deadline: float) -> None:
    await asyncio.sleep(0.2)  # the abuse has begun
    while not done.is_set() and time.monotonic() < deadline and row.bystanders < 1000:
        start = time.monotonic()
        try:
            response = await client.post("/v1/completions", json=completion(target, prompt="The capital of France is"))
            if response.status_code != 200:
                row.notes.append(f"bystander {response.status_code}")
        except httpx.HTTPError as exc:
            row.notes.append(f"bystander {type(exc).__name__}")
        row.bystander_max_s = max(row.bystander_max_s, time.monotonic() - start)
        row.bystanders += 1


async def measure(name: str, abuse: Abuse, target: Target, timeout_s: float) -> Row:
    row, done = Row(name), asyncio.Event()
    deadline = time.monotonic() + timeout_s
    limits = httpx.Timeout(timeout_s)
    async with (
        httpx.AsyncClient(base_url=target.url, timeout=limits, trust_env=False) as abuser,
        httpx.AsyncClient(base_url=target.url, timeout=limits, trust_env=False) as health,
        httpx.AsyncClient(base_url=target.url, timeout=limits, trust_env=False) as bystander,
    ):
        watchers = [
            asyncio.create_task(watch_health(health, row, done, deadline)),
            asyncio.create_task(bystand(bystander, target, row, done, deadline)),
        ]
        start = time.monotonic()
        try:
            row.status = await asyncio.wait_for(abuse(abuser, target), timeout_s)
        except (TimeoutError, httpx.HTTPError, OSError) as exc:
            row.status = type(exc).__name__
        row.abuse_s = time.monotonic() - start
        await asyncio.sleep(0.3)  # one more bystander after the abuse: the server has recovered
        done.set()
        await asyncio.gather(*watchers)
    return row


def report(rows: list[Row]) -> None:
    print(f"{'pattern':<22} {'status':>14} {'abuse s':>8} {'/health max ms':>15} {'fails':>6} {'bystander max ms':>17}")
    for r in rows:
        notes = f" {', '.join(r.notes[:3])}" if r.notes else ""
        print(
            f"{r.name:<22} {r.status:>14} {r.abuse_s:>8.2f} {r.health_max_s * 1000:>15.0f} {r.health_failures:>6}"
            f" {r.bystander_max_s * 1000:>17.0f}  ({r.bystanders} bystanders){notes}"
        )


# --- the server -----------------------------------------------------------------------------------------------------
def server_spec(model: str, port: int, workdir: Path) -> ServerSpec:
    flags = ["--rate-limit-user-tokens", USER_TOKEN_LIMIT]
    if model == "tiny":
        sys.path.insert(0, str(ROOT))
        from tests.tiny_model import write_tiny_model

        model = str(write_tiny_model(workdir / "tiny-model"))
    if model == "default":
        return tokenmill_spec(port, None, flags)
    return tokenmill_spec(port, model, flags, cache_dir=str(workdir / "cache"))


async def target_of(url: str, scale: float) -> Target:
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        info = (await client.get("/tokenizer_info", params={"model": card["id"]})).json()
    return Target(url, card["id"], info["max_model_len"], info["vocab_size"], scale)


async def run_all(url: str, names: list[str], scale: float, timeout_s: float) -> list[Row]:
    target = await target_of(url, scale)
    print(f"{target.model}: context {target.max_model_len}, vocabulary {target.vocab_size}, sizes x{scale:g}")
    rows = []
    for name in names:
        rows.append(await measure(name, PATTERNS[name], target, timeout_s))
        print(f"  {name}: {rows[-1].status} in {rows[-1].abuse_s:.2f} s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (random weights), default (Gemma 3 270M), or a path")
    parser.add_argument("--quick", action="store_true", help="every size at 1/16")
    parser.add_argument("--only", action="append", choices=list(PATTERNS), help="run only this pattern (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the most one pattern may take")
    args = parser.parse_args()
    names = args.only or list(PATTERNS)
    with tempfile.TemporaryDirectory(prefix="tokenmill-abuse-") as tmp:
        server = ManagedServer(server_spec(args.model, free_port(), Path(tmp)), Path(tmp))
        try:
            server.start(timeout_s=600)
            rows = asyncio.run(run_all(server.url, names, 1 / 16 if args.quick else 1.0, args.timeout_s))
            print(f"peak server RSS: {server.peak_rss_mb or 0:.0f} MiB")
        finally:
            server.stop(grace_s=30)
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
