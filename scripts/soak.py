"""Soak test: many mixed requests against one server; every answer checked, nothing may leak.

    python scripts/soak.py                         # 200 requests, a tiny random model it serves itself (~1 min)
    python scripts/soak.py --requests 2000         # the full soak
    python scripts/soak.py --model default --requests 300 --max-tokens 16   # the real Gemma 3 270M
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234          # a server that already runs

The mix: streamed and not, n 1-3, best_of, echo with logprobs, scoring (max_tokens 0), stop strings, seeds, text and
token-id prompts, and a fraction cancelled at a random moment (the client closes the connection). It ends with: every
request that was not cancelled answered correctly (shape, indices, one finish_reason per choice, no stop string in the
text, echo prefix), the server's used KV blocks back to 0, and its RSS growth from the end of the first quarter of the
requests to the end of the last. It exits 1 if any of these fails. Only 127.0.0.1; bounded by --requests and
--timeout-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.servers import ManagedServer, ServerSpec, tokenmill_spec

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "hello world", "the"]
STOPS = ["\n", ".", " the", "e", ", "]


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0
    failures: list[str] = field(default_factory=list)
    rss_kb: dict[str, int] = field(default_factory=dict)


# --- one request --------------------------------------------------------------------------------------------------
def random_request(rng: random.Random, model: str, max_tokens: int, id_prompt: list[int]) -> dict[str, Any]:
    stream = rng.random() < 0.5
    prompt: Any = rng.choice([rng.choice(PROMPTS), rng.sample(PROMPTS, 2), id_prompt])
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, max_tokens)}
    body["n"] = rng.choice([1, 1, 2, 3])
    if not stream and rng.random() < 0.2:
        body["best_of"] = body["n"] + 1
    if rng.random() < 0.25:
        body["echo"], body["logprobs"] = True, rng.choice([0, 1, 2])
        if rng.random() < 0.3:
            body["max_tokens"] = 0  # scoring
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    body["temperature"] = rng.choice([0.0, 0.8])
    if body["temperature"] and rng.random() < 0.5:
        body["seed"] = rng.randint(0, 10**6)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    return body


async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]], str]:
    """(status, chunks or [response], raw text); a stream's chunks are parsed as they arrive."""
    if not body.get("stream"):
        response = await client.post("/v1/completions", json=body)
        return response.status_code, [response.json()], response.text
    chunks: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        raw = ""
        async for line in response.aiter_lines():
            raw += line + "\n"
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return response.status_code, chunks, raw


# --- checking an answer -------------------------------------------------------------------------------------------
def check(body: dict[str, Any], status: int, chunks: list[dict[str, Any]], raw: str, prompts: list[str]) -> str | None:
    """None when the answer is right; else what is wrong."""
    if status != 200:
        return f"status {status}: {raw[:200]}"
    if any("error" in c for c in chunks):
        return f"error: {raw[:200]}"
    if body.get("stream") and not raw.rstrip().endswith("data: [DONE]"):
        return "stream did not end with [DONE]"
    texts, finishes = join_choices(chunks)
    expected = len(prompts) * body["n"]
    if sorted(texts) != list(range(expected)):
        return f"choice indices {sorted(texts)} for {expected} choices"
    for index, text in texts.items():
        problem = check_choice(body, text, finishes[index], prompts[index // body["n"]])
        if problem:
            return f"choice {index}: {problem}"
    return None


def join_choices(chunks: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str | None]]]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str | None]] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            finishes.setdefault(c["index"], []).append(c["finish_reason"])
    return texts, finishes


def check_choice(body: dict[str, Any], text: str, finishes: list[str | None], prompt: str) -> str | None:
    reasons = [f for f in finishes if f is not None]
    if len(reasons) != 1 or finishes[-1] not in ("stop", "length"):
        return f"finish reasons {finishes}"
    if body.get("echo"):
        if not text.startswith(prompt):
            return f"echo text {text[:40]!r} does not start with the prompt"
        text = text[len(prompt) :]
    if body["max_tokens"] == 0 and text:
        return f"max_tokens 0 generated {text!r}"
    stops = body.get("stop") or []
    if any(s in text for s in stops):
        return f"a stop string is in the text {text!r}"
    return None


# --- the run ------------------------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> Tally:
    rng, tally = random.Random(args.seed), Tally()
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        id_prompt = (await client.post("/tokenize", json={"prompt": "token ids prompt"})).json()["tokens"]
        id_text = (await client.post("/detokenize", json={"tokens": id_prompt})).json()["prompt"]
        gate, done = asyncio.Semaphore(args.concurrency), 0
        quarters = {args.requests * q // 4: f"q{q}" for q in (1, 2, 3, 4)}

        async def one(body: dict[str, Any], cancel_after: float | None) -> None:
            nonlocal done
            async with gate:
                await run_one(client, body, cancel_after, tally, id_text)
            done += 1
            if done in quarters and pid is not None:
                tally.rss_kb[quarters[done]] = rss_kb(pid)

        jobs = []
        for _ in range(args.requests):
            body = random_request(rng, model, args.max_tokens, id_prompt)
            cancel_after = rng.uniform(0, 0.3) if rng.random() < args.cancel_fraction else None
            jobs.append(one(body, cancel_after))
        await asyncio.gather(*jobs)
        tally.rss_kb["used_blocks"] = await used_blocks_at_rest(client)
    return tally


async def run_one(
    client: httpx.AsyncClient, body: dict[str, Any], cancel_after: float | None, tally: Tally, id_text: str
) -> None:
    task = asyncio.ensure_future(send(client, body))
    if cancel_after is not None:
        await asyncio.wait({task}, timeout=cancel_after)
        if not task.done():
            task.cancel()  # closes the connection: the server must abort and free everything
            await asyncio.gather(task, return_exceptions=True)
            tally.cancelled += 1
            return
    status, chunks, raw = await task
    prompts = prompt_texts(body["prompt"], id_text)
    problem = check(body, status, chunks, raw, prompts)
    if problem:
        tally.failures.append(f"{problem} <- {json.dumps(body)[:300]}")
    else:
        tally.ok += 1


def prompt_texts(prompt: Any, id_text: str) -> list[str]:
    """What echo returns per prompt: the string as sent, or the token-id prompt decoded (`id_text`)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [id_text]
    return list(prompt)


async def used_blocks_at_rest(client: httpx.AsyncClient) -> int:
    for _ in range(300):  # up to ~30 s for cancelled work to be reaped
        stats = (await client.get("/stats")).json()
        if not stats["num_running"] and not stats["num_waiting"] and not stats["num_used_blocks"]:
            break
        await asyncio.sleep(0.1)
    return int(stats["num_used_blocks"])


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


# --- the server ---------------------------------------------------------------------------------------------------
def server_spec(model: str, port: int, workdir: Path) -> ServerSpec:
    if model == "tiny":
        sys.path.insert(0, str(ROOT))
        from tests.tiny_model import write_tiny_model

        model = str(write_tiny_model(workdir / "tiny-model"))
    if model == "default":
        return tokenmill_spec(port, None, [])
    return tokenmill_spec(port, model, [], cache_dir=str(workdir / "cache"))


def report(args: argparse.Namespace, tally: Tally, elapsed: float) -> bool:
    rss = tally.rss_kb
    growth = (rss["q4"] - rss["q1"]) / rss["q1"] * 100 if "q1" in rss and "q4" in rss else float("nan")
    print(f"requests: {args.requests} (concurrency {args.concurrency}) in {elapsed:.0f} s")
    print(f"answered correctly: {tally.ok}; cancelled: {tally.cancelled}; wrong: {len(tally.failures)}")
    print(f"used KV blocks at the end: {rss.get('used_blocks')}")
    quarters = ", ".join(f"{q}: {rss[q] / 1024:.0f} MiB" for q in ("q1", "q2", "q3", "q4") if q in rss)
    print(f"server RSS after each quarter: {quarters}; growth first → last quarter: {growth:+.1f}%")
    for failure in tally.failures[:10]:
        print("  WRONG:", failure)
    return not tally.failures and rss.get("used_blocks") == 0 and not growth >= args.max_rss_growth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny", help="tiny (random weights), default (Gemma 3 270M), or a path")
    parser.add_argument("--url", help="soak a server that already runs (127.0.0.1) instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent; more fails the run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenmill-soak-") as tmp:
        server = None if args.url else ManagedServer(server_spec(args.model, args.port, Path(tmp)), Path(tmp))
        base_url = args.url or f"http://127.0.0.1:{args.port}"
        try:
            if server is not None:
                server.start(timeout_s=600)
            start = time.monotonic()
            tally = asyncio.run(
                asyncio.wait_for(soak(args, base_url, server.pid if server else args.pid), args.timeout_s)
            )
            return 0 if report(args, tally, time.monotonic() - start) else 1
        finally:
            if server is not None:
                server.stop(grace_s=60)


if __name__ == "__main__":
    sys.exit(main())
