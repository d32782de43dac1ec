"""Prefix affinity: which replica a prompt goes to, so prompts that share their first KV block meet one prefix cache.

Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018). Each replica stands at
`POINTS_PER_REPLICA` points of a ring of 64-bit hashes; a prompt's key, the hash of the token ids of its first
KV-cache block, falls between two points, and the replicas met walking clockwise from there are its order of
preference. The first of them whose load is under the bound takes the prompt. The bound, ceil(c x (load + 1) / n)
for n replicas carrying `load` requests together (but never under DEFAULT_FREE_LOAD), keeps any replica under c
times its fair share: a hot prefix spills to the next replica on the ring instead of queueing behind itself. A replica that joins or leaves moves only
the keys next to its own points, so the other replicas' caches stay warm.

The key is the first block only because that is the unit the engine's prefix cache shares (engine/kv_cache.py: a
block is cached by the hash of its tokens and every block before it), so two prompts can share cached KV only if
their first blocks are equal; a prompt shorter than one block has nothing to share and goes to the less loaded of two replicas at random.
Pure Python, no Ray: the router (cluster/router.py) and the capacity simulation (cluster/sim/cluster.py) both use it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence

POINTS_PER_REPLICA = 64  # virtual nodes: the spread of keys over n replicas is within a few per cent of even
DEFAULT_LOAD_FACTOR = 1.25  # c: the paper's example value; 1 would be perfect balance and no affinity under load
# A replica may always carry this many requests, whatever the others carry: a batching engine runs a few sequences
# for little more than the price of one, so spilling them to another replica would only lose the cache. Without it
# the bound is tight at low load (3 in flight on 2 replicas: ceil(1.25 x 4 / 2) = 3) and hot prefixes spread.
DEFAULT_FREE_LOAD = 8


def prefix_key(token_ids: Sequence[int], block_size: int) -> int | None:
    """The 64-bit hash of the first `block_size` token ids; None when the prompt fills no whole block."""
    if block_size <= 0 or len(token_ids) < block_size:
        return None
    first = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[:block_size])
    return _hash64(first)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashRing:
    """The ring of one set of replicas (ids as strings): `order(key)` is every replica, nearest first."""

    def __init__(self, replicas: Iterable[str], points: int = POINTS_PER_REPLICA) -> None:
        self.replicas = sorted(set(replicas))
        placed = sorted((_hash64(f"{r}#{i}".encode()), r) for r in self.replicas for i in range(points))
        self._hashes = [h for h, _ in placed]
        self._owners = [r for _, r in placed]

    def order(self, key: int) -> list[str]:
        """The distinct replicas met walking clockwise from `key` (wrapping round), each once."""
        if not self._owners:
            return []
        start = bisect.bisect_right(self._hashes, key)
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)], None)
            if len(seen) == len(self.replicas):
                break
        return list(seen)


def load_bound(
    total_load: int, replicas: int, load_factor: float = DEFAULT_LOAD_FACTOR, free_load: int = DEFAULT_FREE_LOAD
) -> int:
    """The most requests one replica may carry, counting the one being placed: ceil(c x (total + 1) / n), and never
    fewer than `free_load`."""
    return max(math.ceil(load_factor * (total_load + 1) / max(replicas, 1)), free_load)


def bounded_order(
    order: Sequence[str],
    loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    free_load: int = DEFAULT_FREE_LOAD,
) -> list[str]:
    """`order` with its first replica under the load bound moved to the front (the rest keep their ring order): the
    replica the prompt goes to, then where to try if that one refuses it."""
    bound = load_bound(sum(loads.get(r, 0) for r in order), len(order), load_factor, free_load)
    chosen = next((r for r in order if loads.get(r, 0) < bound), None)
    if chosen is None:  # cannot happen while c >= 1 (someone is at or below the mean), but a bad c must not fail
        return list(order)
    return [chosen, *(r for r in order if r != chosen)]


def soonest_first(
    order: Sequence[str],
    backlog: Mapping[str, int],
    loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    free_load: int = DEFAULT_FREE_LOAD,
) -> list[str]:
    """Routing by what the replicas report: `order`'s replicas under the load bound, the one with the fewest prompt
    tokens to prefill before this prompt's first token first (`backlog`: the tokens it has yet to prefill and the part
    of this prompt it does not hold), ties to the less loaded and then to `order`; then the rest in `order`.

    Why prefill tokens and not requests: a replica holding a conversation's history saves recomputing it, but a
    replica handed several long uncached prompts has a queue that a count of requests does not show, and each of its
    prompts waits for the others' prefill. Weighing both in tokens sends a prompt to its cached history unless the
    queue there is longer than recomputing the history elsewhere, and spreads new long prompts by the work ahead of
    them (the decode steps each shares are left to the load bound)."""
    bound = load_bound(sum(loads.get(r, 0) for r in order), len(order), load_factor, free_load)
    under = [r for r in order if loads.get(r, 0) < bound] or list(order)
    ranked = sorted(under, key=lambda r: (backlog[r], loads.get(r, 0)))  # stable: `order` breaks ties
    return [*ranked, *(r for r in order if r not in ranked)]


def two_choices(replicas: Sequence[str], rng: random.Random) -> list[str]:
    """No affinity (a prompt with no whole block, or affinity off): two replicas at random, of which the less loaded
    takes it ("power of two choices", Ray Serve's own default)."""
    return rng.sample(list(replicas), min(2, len(replicas)))
