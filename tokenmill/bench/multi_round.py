"""`tokenmill bench --multi-round-qa`: many users, each in a conversation of several rounds, as vLLM production-stack's
multi-round-qa benchmark loads a server (its names: users, rounds, qps, shared system prompt, user history, answer).

Every user's prompt starts with one system prompt that all share, then the user's own history (text of its own, then
each earlier round's question and answer), then the round's question. `users` conversations run at once; a user
whose rounds are done is replaced by a new one, so the server always sees that many. Requests arrive at `qps` in
all (each user waits users / qps seconds between its rounds, the users starting 1 / qps apart), for `duration_s`
seconds: no request starts after that, and those in flight end. What it measures is what a prefix cache and a
router that knows it are for: time to first token as the histories grow, and how much of each prompt the server
found cached (usage.prompt_tokens_details.cached_tokens, where it reports it).

The text is made of common English words in a seeded order, about one token each: lengths are in such words.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import aiohttp

from tokenmill.bench.load import LoadSettings, completion_body, discover, make_client, stream_completion
from tokenmill.bench.loopback import require_loopback
from tokenmill.bench.stats import RequestResult, percentile

# common English words, about a token each in most vocabularies
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from this are be it an or which have not has but were one all"
    " their there can more other some time these two may first than then into only new used most also would over"
    " such after years where many system through between both under while each people same well large part number"
    " during without state water light power city form world house point work place order line study data field"
)
WORDS = tuple(_WORD_TEXT.split(" "))


@dataclasses.dataclass(frozen=True)
class MultiRoundSettings:
    users: int = 8  # conversations at once
    rounds: int = 5  # questions a user asks
    qps: float = 1.0  # requests a second, all users together
    system_words: int = 1000  # the system prompt every user's prompts start with
    history_words: int = 2000  # a user's own text before its first question
    answer_tokens: int = 100
    question_words: int = 20
    duration_s: float = 120.0  # no request starts after this
    request_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 1 or self.rounds < 1 or self.qps <= 0 or self.answer_tokens < 1:
            raise ValueError("users, rounds, qps and answer_tokens must be positive")


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclasses.dataclass
class Asked:
    """One round of one user, as the client saw it."""

    user: int
    round: int
    result: RequestResult
    started_s: float  # from the run's start


async def run_multi_round(url: str, settings: MultiRoundSettings) -> dict[str, Any]:
    """The run against the server at `url` (loopback only): every round asked, and the summary."""
    base_url = require_loopback(url)
    rng = random.Random(settings.seed)
    system = "System: " + text(settings.system_words, rng) + "\n"
    asked: list[Asked] = []
    started = time.perf_counter()
    deadline = started + settings.duration_s
    users = iter(range(1 << 30))
    async with make_client(_load_settings(settings)) as client:
        model, eos_ids = await discover(client, base_url)

        async def seat(first_start: float) -> None:
            """One place at the table: a user's rounds, then the next user's, until the deadline."""
            await asyncio.sleep(first_start)
            while time.perf_counter() < deadline:
                await _converse(client, base_url, model, eos_ids or (), system, next(users), settings, asked, started)

        await asyncio.gather(*(seat(i / settings.qps) for i in range(settings.users)))
    return {"url": base_url, "model": model, "settings": dataclasses.asdict(settings), **summarize(asked, started)}


async def _converse(
    client: aiohttp.ClientSession,
    base_url: str,
    model: str,
    eos_ids: tuple[int, ...],
    system: str,
    user: int,
    settings: MultiRoundSettings,
    asked: list[Asked],
    started: float,
) -> None:
    rng = random.Random(settings.seed * 1_000_003 + user + 1)
    history = f"User {user}: " + text(settings.history_words, rng) + "\n"
    gap = settings.users / settings.qps
    deadline = started + settings.duration_s
    for r in range(settings.rounds):
        if time.perf_counter() >= deadline:
            return
        question = f"Question {r + 1}: {text(settings.question_words, rng)}?\nAnswer:"
        body = completion_body(model, system + history + question, settings.answer_tokens, eos_ids)
        at = time.perf_counter()
        result = await stream_completion(client, base_url, body, settings.request_timeout_s, keep_text=True)
        asked.append(Asked(user, r, result, at - started))
        history += question + (result.text or "") + "\n"
        await asyncio.sleep(max(0.0, gap - (time.perf_counter() - at)))


def summarize(asked: list[Asked], started: float) -> dict[str, Any]:
    """Requests done, their rate and tokens a second over the run, TTFT and latency percentiles (all rounds, and the
    first round against the later ones), and the share of prompt tokens the server reported cached."""
    wall = max((a.started_s + a.result.latency_s for a in asked), default=0.0)
    ok = [a for a in asked if a.result.ok]
    ttft = [a.result.ttft_s for a in ok if a.result.ttft_s is not None]
    later = [a.result.ttft_s for a in ok if a.round > 0 and a.result.ttft_s is not None]
    prompt = sum(a.result.prompt_tokens or 0 for a in ok)
    cached = [a.result.cached_tokens for a in ok if a.result.cached_tokens is not None]
    return {
        "requests": len(asked),
        "failed": len(asked) - len(ok),
        "wall_s": wall,
        "req_s": len(ok) / wall if wall else None,
        "tok_s": sum(a.result.completion_tokens for a in ok) / wall if wall else None,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "later_rounds_ttft_p90_s": percentile(later, 90) if later else None,
        "latency_p50_s": percentile([a.result.latency_s for a in ok], 50) if ok else None,
        "prompt_tokens": prompt,
        "cached_share": sum(cached) / prompt if cached and prompt else None,
        "errors": sorted({a.result.error for a in asked if a.result.error})[:5],
    }


def _load_settings(settings: MultiRoundSettings) -> LoadSettings:
    return LoadSettings(concurrency=(settings.users,), request_timeout_s=settings.request_timeout_s)


def report(result: dict[str, Any]) -> str:
    s = result["settings"]

    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value * 1e3:,.0f} ms"

    share = result["cached_share"]
    cached = "not reported" if share is None else f"{share:.1%} of {result['prompt_tokens']:,}"
    lines = [
        (
            f"multi-round QA on {result['url']} ({result['model']}): {s['users']} users x {s['rounds']} rounds at"
            f" {s['qps']:g} req/s, a {s['system_words']}-word shared system prompt, {s['history_words']} words of"
            f" history each, {s['answer_tokens']}-token answers, {s['duration_s']:g} s"
        ),
        (
            f"requests: {result['requests']} ({result['failed']} failed) over {result['wall_s']:.1f} s:"
            f" {result['req_s'] or 0:.2f} req/s, {result['tok_s'] or 0:.1f} tok/s"
        ),
        (
            f"TTFT p50 {ms(result['ttft_p50_s'])}, p90 {ms(result['ttft_p90_s'])}; after the first round p90"
            f" {ms(result['later_rounds_ttft_p90_s'])}; latency p50 {ms(result['latency_p50_s'])}"
        ),
        f"prompt tokens cached: {cached}",
    ]
    lines += [f"error: {error}" for error in result["errors"]]
    return "\n".join(lines)
