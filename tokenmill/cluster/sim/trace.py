"""The replica simulation's synthetic arrival trace: Poisson arrivals of prompts that share a prefix per group.

A group stands for one system prompt or few-shot header; groups are drawn with Zipf popularity, so a few are hot and
most are rare, as on a real service. Each prompt is its group's prefix followed by a suffix of its own, and is kept
as the chained hashes of its full KV blocks (what a prefix cache can hold) plus its affinity key, not as tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tokenmill.cluster.affinity import prefix_key


def option(default: Any, help: str) -> Any:
    """A dataclass field that is also a command-line flag of `python -m tokenmill.cluster.sim`."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Workload:
    groups: int = option(64, "prefix groups (distinct system prompts / few-shot headers)")
    zipf: float = option(1.0, "Zipf exponent of group popularity (0: all equally likely)")
    prefix_tokens: int = option(256, "tokens of each group's shared prefix")
    suffix_min: int = option(32, "fewest tokens of a prompt's own suffix")
    suffix_max: int = option(96, "most tokens of a prompt's own suffix")
    output_min: int = option(16, "fewest output tokens of a request")
    output_max: int = option(112, "most output tokens of a request")
    block_size: int = option(16, "tokens per KV-cache block, as the engine's --block-size")
    vocab: int = option(32000, "token ids are drawn below this")
    # conversations (vLLM production-stack's multi-round QA): every prompt starts with one shared system prompt of
    # prefix_tokens, then its user's own history, then each earlier round's question and answer, then the question
    # (a suffix's length); a user asks `rounds` questions, `think_s` apart
    conversations: bool = option(False, "multi-round QA users instead of prefix groups (the options below)")
    rounds: int = option(5, "with --conversations: questions each user asks")
    history_tokens: int = option(1000, "with --conversations: tokens of each user's own text before its first question")
    think_s: float = option(10.0, "with --conversations: seconds between a user's questions")

    def __post_init__(self) -> None:
        if self.groups < 1 or self.block_size < 1 or self.vocab < 2:
            raise ValueError("groups, block_size and vocab must be positive")
        if not 1 <= self.suffix_min <= self.suffix_max or not 1 <= self.output_min <= self.output_max:
            raise ValueError("suffix and output ranges must be 1 <= min <= max")
        if self.rounds < 1 or self.history_tokens < 0 or self.think_s <= 0:
            raise ValueError("rounds must be at least 1, history_tokens not negative, think_s positive")

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prefix_tokens + (self.suffix_min + self.suffix_max) / 2

    @property
    def mean_output_tokens(self) -> float:
        return (self.output_min + self.output_max) / 2

    @property
    def mean_warm_tokens(self) -> float:
        """Prompt tokens still to prefill when the group's prefix is cached: its suffix and the prefix's part block."""
        return self.mean_prompt_tokens - self.prefix_tokens // self.block_size * self.block_size


@dataclass(frozen=True)
class Arrival:
    """One request of the trace, as the proxy receives it."""

    index: int
    arrival_s: float
    group: int
    prompt_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the full blocks before the last prompt token
    key: int | None  # prefix_key of the prompt: what the router hashes onto the ring
    output_tokens: int

    def uncached_tokens(self, held_blocks: int, block_size: int) -> int:
        """The prompt tokens a replica computes for it when its cache holds the prompt's first `held_blocks`."""
        return self.prompt_tokens - held_blocks * block_size


def make_trace(workload: Workload, rate: float, count: int, seed: int) -> list[Arrival]:
    """`count` requests arriving as a Poisson process of `rate` per second, the same for the same seed."""
    if workload.conversations:
        return make_conversations(workload, rate, count, seed)
    rng = random.Random(seed)
    prefixes = [rng.choices(range(workload.vocab), k=workload.prefix_tokens) for _ in range(workload.groups)]
    weights = [1 / (g + 1) ** workload.zipf for g in range(workload.groups)]
    trace: list[Arrival] = []
    now = 0.0
    for index in range(count):
        now += rng.expovariate(rate)
        group = rng.choices(range(workload.groups), weights)[0]
        suffix = rng.choices(range(workload.vocab), k=rng.randint(workload.suffix_min, workload.suffix_max))
        tokens = prefixes[group] + suffix
        output = rng.randint(workload.output_min, workload.output_max)
        key = prefix_key(tokens, workload.block_size)
        trace.append(Arrival(index, now, group, len(tokens), block_hashes(tokens, workload.block_size), key, output))
    return trace


def block_hashes(tokens: list[int], block_size: int) -> tuple[int, ...]:
    """Each full block's hash chained with the one before, as engine/kv_cache.py keys its prefix cache. Only blocks
    inside tokens[:-1] count: the engine always computes the last prompt token, for its logits."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, (len(tokens) - 1) // block_size * block_size, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))  # ints and tuples hash the same every run
        hashes.append(parent)
    return tuple(hashes)


def make_conversations(workload: Workload, rate: float, count: int, seed: int) -> list[Arrival]:
    """`count` requests of multi-round QA users: users start as a Poisson process (rate / rounds a second, so that
    their questions come at `rate`), each asks its rounds `think_s` apart (whatever its answers' times: an open
    loop), and a round's prompt is the system prompt, the user's history, and every earlier question and answer
    before its own. `group` is the user."""
    rng = random.Random(seed)
    system = rng.choices(range(workload.vocab), k=workload.prefix_tokens)
    asked: list[tuple[float, int, list[int], int]] = []  # (arrival, user, prompt tokens, output tokens)
    start, user = 0.0, 0
    while len(asked) < count:
        start += rng.expovariate(rate / workload.rounds)
        context = system + rng.choices(range(workload.vocab), k=workload.history_tokens)
        for r in range(workload.rounds):
            question = rng.choices(range(workload.vocab), k=rng.randint(workload.suffix_min, workload.suffix_max))
            output = rng.randint(workload.output_min, workload.output_max)
            context = context + question
            asked.append((start + r * workload.think_s, user, context, output))
            context = context + rng.choices(range(workload.vocab), k=output)  # its answer, in the next prompts
        user += 1
    asked.sort(key=lambda a: a[0])
    return [
        Arrival(
            i,
            at,
            who,
            len(tokens),
            block_hashes(tokens, workload.block_size),
            prefix_key(tokens, workload.block_size),
            out,
        )
        for i, (at, who, tokens, out) in enumerate(asked[:count])
    ]
