"""Every way to cut a vocabulary's tokens into two tokens of the same vocabulary, found in C or with numpy.

A SentencePiece vocabulary without merges (Gemma's GGUF) gets them from its own pieces: each split of a token into
two pieces that are tokens themselves. Slicing Gemma 3's 262,144 Python strings at each of their 1.2 million cuts
and looking both halves up in a dict takes most of the tokenizer's build. Where the C kernels are built, one pass of
theirs does it (kernels/token_splits.c, a hash table of the pieces); elsewhere numpy does, the cuts taken one position
at a time for all the tokens at once: a polynomial hash of each token's prefix grows by one code point a step, the
suffix's hash follows from the whole token's, and both are looked up in a hash table of the tokens' own hashes; each
hit is then checked code point by code point against the tokens it names.

Exact: where two different tokens share a hash nothing is decided (the caller slices instead), so a cut's halves,
when they are tokens, find themselves, and a hit on a string that is not a token fails the check. The arrays hold
one entry per token, per hit or per cut (no tokens x length matrix): ~20 MB for Gemma 3.
"""

from __future__ import annotations

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd: multiplying by it modulo 2^64 loses nothing
_SPREAD = 0xD6E8FEB86659FD93  # odd, another: spreads the hashes over the table's slots


def split_pairs(tokens: list[str], distinct: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(left, right): token indices such that tokens[left[i]] + tokens[right[i]] is a token, for every cut of every
    token into two tokens, in the order token by token (file order), the longer left piece first. `distinct`: how
    many different strings `tokens` holds. None where two different strings share a hash (nothing is decided)."""
    n = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    width = int(lengths.max()) if n else 0
    code_points = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    if n and (in_c := _in_c(code_points, starts, lengths)) is not None:
        return in_c
    codes = code_points.astype(np.uint64)
    powers = np.array([pow(_BASE, k, 1 << 64) for k in range(width + 1)], dtype=np.uint64)
    one, base = np.uint64(1), np.uint64(_BASE)

    # each token's hash, its prefix's grown a code point at a time (each + 1, so that none hashes as nothing); kept on
    # the way for the cuts, steps[j - 1]: the tokens longer than j and the hashes of their first j code points
    whole, rows = np.zeros(n, np.uint64), np.flatnonzero(lengths > 0)  # the empty string's hash is 0
    prefix = np.zeros(len(rows), np.uint64)
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    for j in range(width):
        prefix = prefix * base + codes[starts[rows] + j] + one
        ended = lengths[rows] == j + 1
        whole[rows[ended]] = prefix[ended]
        rows, prefix = rows[~ended], prefix[~ended]
        steps.append((rows, prefix))
    table = _HashTable(whole)
    if len(table) != distinct:
        return None

    found: list[tuple[np.ndarray, ...]] = []
    for cut in range(1, width):
        rows, prefix = steps[cut - 1]
        left = table.find(prefix)
        at = np.flatnonzero(left >= 0)
        hits, left = rows[at], left[at]
        right = table.find(whole[hits] - prefix[at] * powers[lengths[hits] - cut])
        at = np.flatnonzero((right >= 0) & (lengths[left] == cut))
        hits, left, right = hits[at], left[at], right[at]
        # the check, code point by code point: the left piece against the token's first `cut`, the right piece
        # against the rest (the hits longest right piece first, so that those still going are a leading slice)
        same = np.ones(len(hits), bool)
        for k in range(cut):
            same &= codes[starts[left] + k] == codes[starts[hits] + k]
        longest = np.argsort(-lengths[right], kind="stable")
        hits, left, right, same = hits[longest], left[longest], right[longest], same[longest]
        right_lengths = lengths[right]
        for k in range(int(right_lengths[0]) if len(hits) else 0):
            going = int(np.searchsorted(-right_lengths, -k, side="left"))  # right pieces longer than k
            same[:going] &= codes[starts[right[:going]] + k] == codes[starts[hits[:going]] + cut + k]
        found.append((hits[same], np.full(int(same.sum()), cut), left[same], right[same]))
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    hits, cuts, left, right = (np.concatenate(column) for column in zip(*found))
    ranking = np.lexsort((-cuts, hits))  # token by token, the longest left piece first
    return left[ranking], right[ranking]


def _in_c(codes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The same pairs from the C kernels' one pass (token_splits.c), exact; None where they are not built."""
    from tokenmill.kernels import ops  # here, not at the top: the kernels' Python side imports torch

    return ops.token_splits(codes, starts, lengths)


class _HashTable:
    """The tokens' distinct hashes in an open-addressing table (linear probing, a quarter full or less), built and
    searched a whole array at a time: a probe round per displacement, a few rounds in all."""

    def __init__(self, hashes: np.ndarray) -> None:
        keys, first = np.unique(hashes, return_index=True)  # a token per distinct hash: its first
        self.bits = max(int(4 * len(keys)).bit_length(), 1)
        size = 1 << self.bits
        self.keys = np.zeros(size, np.uint64)
        self.ids = np.full(size, -1, np.int64)  # -1: an empty slot
        self.count = len(keys)
        slot, pending = self._home(keys), np.arange(len(keys))
        while len(pending):
            free = self.ids[slot] < 0
            taken, winner = np.unique(slot[free], return_index=True)  # one key per free slot a round
            placed = pending[free][winner]
            self.keys[taken], self.ids[taken] = keys[placed], first[placed]
            done = np.zeros(len(pending), bool)
            done[np.flatnonzero(free)[winner]] = True
            pending, slot = pending[~done], (slot[~done] + 1) & (size - 1)

    def __len__(self) -> int:
        return self.count

    def _home(self, hashes: np.ndarray) -> np.ndarray:
        """the slot a hash goes to first: the top bits of the hash times an odd constant (a one-code-point token's
        hash is small, and its own top bits would all be 0)"""
        return ((hashes * np.uint64(_SPREAD)) >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """The token index holding each hash, or -1."""
        found = np.full(len(hashes), -1, np.int64)
        slot, pending = self._home(hashes), np.arange(len(hashes))
        mask = len(self.ids) - 1
        while len(pending):
            ids = self.ids[slot]
            hit = (ids >= 0) & (self.keys[slot] == hashes[pending])
            found[pending[hit]] = ids[hit]
            going = (ids >= 0) & ~hit  # an occupied slot of another hash: probe the next
            pending, slot = pending[going], (slot[going] + 1) & mask
        return found
