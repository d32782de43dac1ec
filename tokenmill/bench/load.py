"""The load generator: streamed, greedy completion requests with EOS banned, sent one at a time (single-stream decode)
or from N concurrent clients. Every loop is bounded in count and in time, and only loopback URLs are accepted.

The generator shares the machine's cores with the server it measures, so the CPU it spends per streamed token is taken
from that server, and the more so the faster the server streams. It runs on aiohttp (a C HTTP parser) under uvloop:
httpx on asyncio's loop spent about four times as much a token (`scripts/served_level.py` prints the figure;
docs/decisions/0021-load-generator.md has both)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from tokenmill.bench.loopback import require_loopback
from tokenmill.bench.stats import RequestResult, summarize_level, summarize_single
from tokenmill.bench.workloads import PROMPTS


@dataclass(frozen=True)
class LoadSettings:
    max_tokens: int = 128
    eos_ids: tuple[int, ...] | None = None  # None: ask the server's /tokenizer_info
    single_runs: int = 2
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int | None = None  # per concurrency level; None: twice the concurrency, at least 4
    level_timeout_s: float = 300.0  # no new request starts after this; in-flight ones have request_timeout_s
    request_timeout_s: float = 300.0
    api_key: str | None = None
    # prompt lengths (tokens, about) whose prefill is timed alone: one fresh prompt each, one new token
    prefill_tokens: tuple[int, ...] = (512, 8000)
    prompts: tuple[str, ...] = PROMPTS  # the workload's (workloads.py); requests take them in turn
    # fields request i adds to its body, the i-th modulo their number (a --lora run's adapter); the single stream's
    # and the warm-up's are the first
    variants: tuple[dict[str, Any], ...] = ()

    def requests_for(self, concurrency: int) -> int:
        return max(self.requests, 1) if self.requests is not None else max(2 * concurrency, 4)

    def body(
        self, model: str, i: int, eos_ids: tuple[int, ...], max_tokens: int | None = None, variant: int | None = None
    ) -> dict[str, Any]:
        """Request i's body: its prompt (the i-th in turn) and its variant's fields (the i-th, unless told)."""
        body = completion_body(model, self.prompts[i % len(self.prompts)], max_tokens or self.max_tokens, eos_ids)
        if not self.variants:
            return body
        return {**body, **self.variants[(i if variant is None else variant) % len(self.variants)]}


def completion_body(model: str, prompt: str, max_tokens: int, eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """A plain greedy streamed request every OpenAI-compatible server handles; EOS banned so it runs to max_tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},  # servers that ignore it are counted from the finish reason
        "logit_bias": {str(i): -100 for i in eos_ids},
    }


async def stream_completion(
    client: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    timeout_s: float = 300.0,
    keep_text: bool = False,
) -> RequestResult:
    """One streamed request, bounded in total time (the client's own timeout only bounds each read); `keep_text`:
    the result carries the text too."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(f"{base_url}/v1/completions", json=body, allow_redirects=False) as response:
                if response.status != 200:
                    detail = (await response.read()).decode(errors="replace")[:300]
                    return _failed(start, f"HTTP {response.status}: {detail}")
                return await _read_stream(response, start, body["max_tokens"], keep_text)
    except TimeoutError:
        return _failed(start, f"no complete answer within {timeout_s:g} s")
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: bad JSON, bad UTF-8, a line over the read buffer
        return _failed(start, f"{type(exc).__name__}: {exc}")


async def _read_stream(
    response: aiohttp.ClientResponse, start: float, max_tokens: int, keep_text: bool = False
) -> RequestResult:
    first = last = None
    chunks, finish, usage = 0, None, None
    digest, pieces = hashlib.sha256(), []
    async for line in response.content:  # split at b"\n": an SSE event's lines
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            return _failed(start, f"error in stream: {chunk['error']}")
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            if choice.get("text"):
                digest.update(choice["text"].encode())
                if keep_text:
                    pieces.append(choice["text"])
                last = time.perf_counter() - start
                first = last if first is None else first
                chunks += 1
    tokens, exact = _count_tokens(usage, finish, max_tokens, chunks)
    return RequestResult(
        True,
        time.perf_counter() - start,
        first,
        last,
        tokens,
        exact,
        _finish(finish, tokens, exact, max_tokens),
        text_digest=digest.hexdigest()[:16],
        text="".join(pieces) if keep_text else None,
        prompt_tokens=usage.get("prompt_tokens") if usage else None,
        cached_tokens=((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
    )


def _finish(finish: str | None, tokens: int, exact: bool, max_tokens: int) -> str | None:
    """The finish reason, except that a "stop" whose usage counts all of max_tokens is the "length" it was: a server
    that labels every end "stop" (ik_llama.cpp's) would otherwise read as stopping early in the bench's notes."""
    return "length" if finish == "stop" and exact and tokens >= max_tokens else finish


def _count_tokens(usage: dict[str, Any] | None, finish: str | None, max_tokens: int, chunks: int) -> tuple[int, bool]:
    """Real completion tokens: from usage, else all of max_tokens on a "length" finish, else (estimated) chunks."""
    if usage and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"]), True
    if finish == "length":
        return max_tokens, True
    return chunks, False


def _failed(start: float, error: str) -> RequestResult:
    return RequestResult(False, time.perf_counter() - start, None, None, 0, True, None, error)


async def run_single(
    client: aiohttp.ClientSession, base_url: str, model: str, settings: LoadSettings, eos_ids: tuple[int, ...]
) -> dict[str, Any]:
    """Sequential requests, one stream at a time, taking the prompts in turn: decode tokens/s and TTFT with nothing
    else running."""
    deadline = time.perf_counter() + settings.level_timeout_s
    results = []
    for i in range(settings.single_runs):
        if time.perf_counter() > deadline:
            break
        body = settings.body(model, i, eos_ids, variant=0)
        results.append(await stream_completion(client, base_url, body, settings.request_timeout_s))
    return summarize_single(results)


PASSAGE = " ".join(PROMPTS) + "\n"
CUT_SHARE = 0.9  # a prompt read as fewer than this share of the tokens asked for was cut by the server


async def run_prefills(
    client: aiohttp.ClientSession, base_url: str, model: str, settings: LoadSettings
) -> list[dict[str, Any]]:
    """The time to read one prompt of about each of settings.prefill_tokens tokens and answer one token, with
    nothing else running.

    Each prompt is the bench's prompts repeated, cut to its length at the server's own count of the passage (one
    one-token probe's usage, asked once), and opened by a random line: no server can reuse a prefix it cached in an
    earlier round. The rate is the prompt's tokens (the answer's usage) over the request's whole time."""
    if not settings.prefill_tokens:
        return []
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            probe = await _complete(client, base_url, {"model": model, "prompt": PASSAGE, "max_tokens": 1})
        passage_tokens = max(int(probe["usage"]["prompt_tokens"]), 1)
    except TimeoutError:
        return [
            _prefill_failed(n, f"no answer within {settings.request_timeout_s:g} s") for n in settings.prefill_tokens
        ]
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
        return [_prefill_failed(n, f"{type(exc).__name__}: {exc}"[:300]) for n in settings.prefill_tokens]
    return [await _run_prefill(client, base_url, model, settings, n, passage_tokens) for n in settings.prefill_tokens]


def _prefill_failed(length: int, error: str) -> dict[str, Any]:
    return {"length": length, "prompt_tokens": None, "seconds": None, "tok_s": None, "error": error}


async def _run_prefill(
    client: aiohttp.ClientSession, base_url: str, model: str, settings: LoadSettings, length: int, passage_tokens: int
) -> dict[str, Any]:
    """One prompt of about `length` tokens (run_prefills), the passage being `passage_tokens` of the server's."""
    chars = int(length * len(PASSAGE) / passage_tokens)
    text = f"Document {random.randrange(10**9)}.\n" + (PASSAGE * (chars // len(PASSAGE) + 1))[:chars]
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            start = time.perf_counter()
            answer = await _complete(client, base_url, body)
            seconds = time.perf_counter() - start
        read = int(answer["usage"]["prompt_tokens"])
    except TimeoutError:
        return _prefill_failed(length, f"no answer within {settings.request_timeout_s:g} s")
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
        return _prefill_failed(length, f"{type(exc).__name__}: {exc}"[:300])
    result: dict[str, Any] = {"length": length, "prompt_tokens": read, "seconds": seconds, "tok_s": None, "error": None}
    if read < CUT_SHARE * length:  # a server that keeps a prompt's end when it overflows a slot (ik_llama.cpp)
        result["error"] = f"the server cut the prompt to {read} tokens"
    else:
        result["tok_s"] = read / seconds
    return result


async def prefill_only(url: str, settings: LoadSettings) -> list[dict[str, Any]]:
    """run_prefills, and nothing else (a server started for long prompts alone)."""
    base_url = require_loopback(url)
    async with make_client(settings) as client:
        model, _ = await discover(client, base_url)
        return await run_prefills(client, base_url, model, settings)


async def _complete(client: aiohttp.ClientSession, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed completion's JSON body; an error status raises ValueError with the server's words."""
    async with client.post(f"{base_url}/v1/completions", json=body, allow_redirects=False) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")[:200]
            raise ValueError(f"HTTP {response.status}: {detail}")
        answer: dict[str, Any] = await response.json(content_type=None)
        return answer


async def run_level(
    client: aiohttp.ClientSession,
    base_url: str,
    model: str,
    settings: LoadSettings,
    eos_ids: tuple[int, ...],
    concurrency: int,
) -> dict[str, Any]:
    """`concurrency` clients share a fixed number of requests; none starts after the level's deadline."""
    indexed, elapsed_s = await level_requests(client, base_url, model, settings, eos_ids, concurrency)
    summary = summarize_level([result for _, result in indexed], elapsed_s, concurrency)
    digests: list[str | None] = [None] * (max((i for i, _ in indexed), default=-1) + 1)
    for i, result in indexed:
        digests[i] = result.text_digest
    return {**summary, "digests": digests}  # by request index: request i asked prompt i modulo their number


async def level_requests(
    client: aiohttp.ClientSession,
    base_url: str,
    model: str,
    settings: LoadSettings,
    eos_ids: tuple[int, ...],
    concurrency: int,
) -> tuple[list[tuple[int, RequestResult]], float]:
    """The requests of run_level's level, each result with its request's index (in the order they ended), and the
    level's duration: for tools that look at each request (scripts/ttft_spread.py, scripts/served_level.py)."""
    total = settings.requests_for(concurrency)
    indices = itertools.count()
    results: list[tuple[int, RequestResult]] = []
    deadline = time.perf_counter() + settings.level_timeout_s

    async def client_loop() -> None:
        while time.perf_counter() < deadline and (i := next(indices)) < total:
            body = settings.body(model, i, eos_ids)
            results.append((i, await stream_completion(client, base_url, body, settings.request_timeout_s)))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def discover(client: aiohttp.ClientSession, base_url: str) -> tuple[str, tuple[int, ...] | None]:
    """The served model id (first of /v1/models) and the EOS ids /tokenizer_info reports, where the server has it."""
    async with client.get(f"{base_url}/v1/models", allow_redirects=False) as models:
        models.raise_for_status()
        model = (await models.json(content_type=None))["data"][0]["id"]
    async with client.get(f"{base_url}/tokenizer_info", allow_redirects=False) as info:
        if info.status != 200:
            return model, None
        body = await info.json(content_type=None)
    ids = body.get("eos_token_ids") or [body.get("eos_token_id")]
    return model, tuple(int(i) for i in ids if i is not None) or None


async def served_stats(client: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """The engine's counters, where the server has them (tokenmill's /stats); {} elsewhere."""
    async with client.get(f"{base_url}/stats", allow_redirects=False) as stats:
        return dict(await stats.json(content_type=None)) if stats.status == 200 else {}


async def served_weight_bytes(client: aiohttp.ClientSession, base_url: str) -> int | None:
    """The bytes of weights a decode step reads, where the server says (tokenmill's /stats); None elsewhere."""
    value = (await served_stats(client, base_url)).get("weight_bytes_per_token")
    return int(value) if isinstance(value, int) and value > 0 else None


def served_eos_ids(url: str, settings: LoadSettings) -> tuple[int, ...]:
    """The EOS ids the server at `url` reports (discover), or none."""

    async def ask() -> tuple[int, ...]:
        async with make_client(settings) as client:
            return (await discover(client, url))[1] or ()

    return run(ask())


def make_client(settings: LoadSettings) -> aiohttp.ClientSession:
    """The load generator's HTTP client (call it on a running event loop); use it in `async with`."""
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    most = max((*settings.concurrency, 1))
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=settings.request_timeout_s),
        # a connection a request: llama-server closes one after a stream in spite of its Keep-Alive header, and a
        # pooled connection taken again before its close arrived failed the next request's write
        connector=aiohttp.TCPConnector(limit=most + 4, force_close=True),
        trust_env=False,  # never route through a proxy from the environment
    )


T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run the load generator's coroutine on uvloop where it is installed (uvicorn[standard] brings it on Linux and
    macOS), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def bench_url(
    url: str, settings: LoadSettings, read_bandwidth: Callable[[], float] | None = None
) -> dict[str, Any]:
    """One pass over a server: a warm-up request, the single-stream runs, the prefill of each prompt length, then
    each concurrency level.
    `read_bandwidth` (GB/s), where given, is measured just before and just after the single-stream runs, with the
    server idle: the machine's memory bandwidth drifts by the minute, so the limit a decode is held to must be the
    one it ran under (single["memory_read_gb_s"]: the two figures)."""
    base_url = require_loopback(url)
    async with make_client(settings) as client:
        model, served_eos = await discover(client, base_url)
        eos_ids = settings.eos_ids if settings.eos_ids is not None else (served_eos or ())
        warmup = settings.body(model, 0, eos_ids, max_tokens=8)
        await stream_completion(client, base_url, warmup, settings.request_timeout_s)
        before = read_bandwidth() if read_bandwidth is not None else None
        single = await run_single(client, base_url, model, settings, eos_ids)
        if read_bandwidth is not None:
            single["memory_read_gb_s"] = [before, read_bandwidth()]
        prefill = await run_prefills(client, base_url, model, settings)
        levels = [await run_level(client, base_url, model, settings, eos_ids, c) for c in settings.concurrency]
        weight_bytes = await served_weight_bytes(client, base_url)
    return {
        "url": base_url,
        "model": model,
        "eos_ids": list(eos_ids),
        "single": single,
        "prefill": prefill,
        "levels": levels,
        "weight_bytes_per_token": weight_bytes,
    }
