"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts and prefix-cache hashes.

The tensors themselves are plain per-layer (num_blocks * block_size, kv_heads, head_dim) buffers (with an 8-bit cache,
each row is head_dim codes and their scales' bytes); this file only decides which slots a sequence owns. A full block of prompt tokens is remembered by a hash of its tokens chained with
the previous block's hash, so a later prompt with the same prefix reuses the block instead of recomputing it. Freed
blocks keep their hash until they are handed out again, so a cache hit can revive them. Where the engine has tiers
(kv_tiers.py), a cached block's KV is copied out before it is handed out again, and a prefix matched no further here
goes on matching there.

The hash is SHA-256, as vLLM's is: a collision would hand one prompt another's KV, so the key must be one no client can
collide on purpose. A request's `cache_salt` starts its chain, so only requests with the same salt share blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokenmill.engine.kv_tiers import KVTiers
from tokenmill.kernels import ops
from tokenmill.model.model_config import ModelConfig


def allocate_kv_tensors(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), each (slots, KV heads, head_dim) of `dtype`, or with kv_dtype int8 (slots, KV
    heads, int8_row_bytes) int8: a row's codes, then their float16 scales' bytes (attention.quantize_kv)."""
    shape: tuple[int, ...] = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_dtype == "int8":
        shape, dtype = (*shape[:2], int8_row_bytes(cfg.head_dim)), torch.int8
    # empty, not zeros: untouched pages cost no memory, and attention only reads slots that were written
    return [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


class KVCacheFormatError(ValueError):
    """The KV cache's dtype does not fit the model (an 8-bit cache's rows are whole blocks of 32 values)."""


def int8_row_bytes(head_dim: int) -> int:
    """An 8-bit cache row: a code per value and a float16 scale per KV_INT8_BLOCK of them, as llama.cpp's q8_0."""
    if head_dim % ops.KV_INT8_BLOCK:
        raise KVCacheFormatError(
            f"--kv-cache-dtype int8 needs attention heads of a multiple of {ops.KV_INT8_BLOCK} values; this model's"
            f" are {head_dim}"
        )
    return head_dim + 2 * head_dim // ops.KV_INT8_BLOCK


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    row = int8_row_bytes(cfg.head_dim) if kv_dtype == "int8" else cfg.head_dim * dtype.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * row


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """SHA-256 of the previous block's hash (the chain's root for the first block) and this block's token ids."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def chain_root(salt: str | None, adapter: str | None = None) -> bytes:
    """Where a chain starts: nothing without a salt or an adapter (the digest of its weights), else their hash (32
    bytes, so never equal)."""
    if salt is None and adapter is None:
        return b""
    digest = hashlib.sha256(b"cache_salt\0" + salt.encode() if salt is not None else b"no_salt\0")
    if adapter is not None:
        digest.update(b"\0adapter\0" + adapter.encode())
    return digest.digest()


class PrefixHashes:
    """A sequence's chained block hashes, computed once each as its blocks fill (its tokens only ever grow)."""

    def __init__(self, salt: str | None = None, adapter: str | None = None) -> None:
        self.root = chain_root(salt, adapter)
        self.hashes: list[bytes] = []

    def block(self, index: int, tokens: Seq[int], block_size: int) -> bytes:
        while len(self.hashes) <= index:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(block_hash(parent, tokens[i * block_size : (i + 1) * block_size]))
        return self.hashes[index]


@dataclass
class Allocation:
    blocks: list[int]
    num_cached_tokens: int  # leading tokens whose KV is already in the reused blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, tiers: KVTiers | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tiers = tiers  # where cached blocks go when evicted, and come back from
        self._evicted: list[tuple[bytes, int]] = []  # cached blocks just handed out again, their KV not yet spilled
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first
        # the free blocks that hold no cached prefix, handed out from the end (popitem): first the last freed, then
        # the never-used ones from block 0 up; all before any cached prefix is evicted, so the pages a run touches
        # stay near its working set instead of growing over the whole cache (the tensors are allocated untouched)
        self.blank: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self.hash_to_block: dict[bytes, int] = {}
        self.block_to_hash: dict[int, bytes] = {}

    def held_keys(self, most: int) -> list[bytes]:
        """Up to `most` prefix-cache keys whose blocks a prompt could reuse here: the live cache's, the latest
        registered first, then the RAM tier's, the latest used first (what a router that prefers replicas holding a
        prompt's prefix reads)."""
        keys = list(reversed(self.hash_to_block))[:most]
        if self.tiers is not None and len(keys) < most:
            keys += [k for k in reversed(self.tiers.ram.entries) if k not in self.hash_to_block][: most - len(keys)]
        return keys

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_prompt(
        self, tokens: Seq[int], use_cache: bool, hashes: PrefixHashes | None = None
    ) -> Allocation | None:
        """Blocks for a whole prompt, reusing cached full blocks of its prefix; None if they don't fit now.

        Only blocks inside tokens[:-1] are matched: the last prompt token is always computed, since its logits are
        needed and its KV must not be written into a block another sequence shares.
        """
        hashes = hashes or PrefixHashes()
        cached = self._match_prefix(tokens, hashes) if use_cache else []
        tiered = self._match_tiers(tokens, hashes, len(cached)) if use_cache else []
        fresh_needed = self.blocks_needed(len(tokens)) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        if fresh_needed > self.num_free - revived:
            return None
        # fetched before fresh blocks are taken: taking them may evict cached blocks into RAM, and those the LRU
        payloads = self.tiers.fetch(tiered) if self.tiers is not None and tiered else []
        for b in cached:
            self._take(b)
        fresh = [self._take_fresh() for _ in range(fresh_needed)]
        self._spill()
        if payloads:
            assert self.tiers is not None
            loaded = fresh[: len(payloads)]
            self.tiers.place(loaded, payloads)
            for h, b in zip(tiered, loaded):
                self._register(h, b)
            cached += loaded
            fresh = fresh[len(loaded) :]
        return Allocation(cached + fresh, len(cached) * self.block_size)

    def cached_tokens(self, tokens: Seq[int], hashes: PrefixHashes) -> int:
        """How many of the prompt's leading tokens allocate_prompt would find cached now, here or in the tiers."""
        live = len(self._match_prefix(tokens, hashes))
        return (live + len(self._match_tiers(tokens, hashes, live))) * self.block_size

    def _match_prefix(self, tokens: Seq[int], hashes: PrefixHashes) -> list[int]:
        matched: list[int] = []
        for i in range((len(tokens) - 1) // self.block_size):
            block = self.hash_to_block.get(hashes.block(i, tokens, self.block_size))
            if block is None:
                break
            matched.append(block)
        return matched

    def _match_tiers(self, tokens: Seq[int], hashes: PrefixHashes, start: int) -> list[bytes]:
        """The chain hashes of the prompt's blocks after the first `start` that the tiers hold, in order."""
        if self.tiers is None:
            return []
        found: list[bytes] = []
        for i in range(start, (len(tokens) - 1) // self.block_size):
            h = hashes.block(i, tokens, self.block_size)
            if not self.tiers.has(h):
                break
            found.append(h)
        return found

    def can_append(self) -> bool:
        return self.num_free > 0

    def append_block(self) -> int:
        block = self._take_fresh()
        self._spill()
        return block

    def fork(self, blocks: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """Share a sequence's full blocks with a child; its partial last block is copied: returns (src, dst)."""
        full = num_tokens // self.block_size
        shared = blocks[:full]
        for b in shared:
            self._take(b)
        if full == len(blocks):
            return shared, None
        dst = self._take_fresh()
        self._spill()
        return shared + [dst], (blocks[full], dst)

    def register_full_blocks(
        self, tokens: Seq[int], blocks: list[int], num_computed: int, hashes: PrefixHashes | None = None, first: int = 0
    ) -> int:
        """Remember the hashes of the computed full blocks so later prompts can reuse them; returns how many blocks are
        full. `first`: the blocks before it were registered by an earlier call (a decode step fills at most one)."""
        hashes = hashes or PrefixHashes()
        full = num_computed // self.block_size
        new: list[tuple[bytes, int]] = []
        for i in range(first, full):
            h = hashes.block(i, tokens, self.block_size)
            if self._register(h, blocks[i]):
                new.append((h, blocks[i]))
        if new and self.tiers is not None:
            self.tiers.registered([h for h, _ in new], [b for _, b in new])
        return full

    def _register(self, h: bytes, block: int) -> bool:
        """Offer a computed full block to the prefix cache under its chain hash; False where either is known."""
        if block in self.block_to_hash or h in self.hash_to_block:
            return False
        self.hash_to_block[h] = block
        self.block_to_hash[block] = h
        return True

    def free_blocks(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks first, so prefix blocks stay cached the longest
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if b not in self.block_to_hash:
                    self.blank[b] = None

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
            self.blank.pop(block, None)
        self.ref_counts[block] += 1

    def _spill(self) -> None:
        """The KV of the cached blocks just handed out again copied to the tiers, in one pass, before anything
        writes into those blocks."""
        if self._evicted:
            assert self.tiers is not None
            self.tiers.evicted([h for h, _ in self._evicted], [b for _, b in self._evicted])
            self._evicted.clear()

    def _take_fresh(self) -> int:
        """A free block for new tokens: the last freed one that holds no cached prefix, else (every free block holds
        one) the least recently freed cached prefix, evicted."""
        if self.blank:
            block, _ = self.blank.popitem()
            del self.free[block]
        else:
            block, _ = self.free.popitem(last=False)
            old = self.block_to_hash.pop(block, None)
            if old is not None:
                del self.hash_to_block[old]
                if self.tiers is not None:
                    self._evicted.append((old, block))
        self.ref_counts[block] = 1
        return block
