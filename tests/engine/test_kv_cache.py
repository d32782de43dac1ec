from __future__ import annotations

import hashlib
from array import array

import pytest

from tokenmill.engine import kv_cache
from tokenmill.engine.kv_cache import BlockManager, PrefixHashes


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    alloc = bm.allocate_prompt(list(range(10)), use_cache=True)
    assert alloc is not None and len(alloc.blocks) == 3 and alloc.num_cached_tokens == 0
    assert bm.num_used == 3
    bm.free_blocks(alloc.blocks)
    assert bm.num_used == 0 and bm.num_free == 8


def test_prefix_blocks_are_reused_after_registration() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(13))
    a = bm.allocate_prompt(prompt, use_cache=True)
    assert a is not None
    bm.register_full_blocks(prompt, a.blocks, len(prompt))
    b = bm.allocate_prompt(prompt[:12] + [99, 100], use_cache=True)
    assert b is not None
    assert b.blocks[:3] == a.blocks[:3] and b.num_cached_tokens == 12
    assert all(bm.ref_counts[x] == 2 for x in a.blocks[:3])
    bm.free_blocks(a.blocks)
    bm.free_blocks(b.blocks)
    assert bm.num_used == 0


def test_last_prompt_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    a = bm.allocate_prompt(prompt, use_cache=True)
    assert a is not None
    bm.register_full_blocks(prompt, a.blocks, 8)
    b = bm.allocate_prompt(prompt, use_cache=True)
    assert b is not None and b.num_cached_tokens == 4 and b.blocks[1] != a.blocks[1]


def test_freed_cached_blocks_are_revived_and_evicted_oldest_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = bm.allocate_prompt(prompt, use_cache=True)
    assert a is not None
    bm.register_full_blocks(prompt, a.blocks, 5)
    bm.free_blocks(a.blocks)
    revived = bm.allocate_prompt(prompt, use_cache=True)
    assert revived is not None and revived.num_cached_tokens == 4
    bm.free_blocks(revived.blocks)
    other = bm.allocate_prompt(list(range(100, 108)), use_cache=True)  # needs all 4 blocks: evicts the cache
    assert other is not None and bm.num_free == 0
    assert bm.allocate_prompt([9], use_cache=True) is None
    bm.free_blocks(other.blocks)
    again = bm.allocate_prompt(prompt, use_cache=True)
    assert again is not None and again.num_cached_tokens == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate_prompt(list(range(6)), use_cache=False)
    assert a is not None
    blocks, copy = bm.fork(a.blocks, 6)
    assert blocks[0] == a.blocks[0] and bm.ref_counts[a.blocks[0]] == 2
    assert copy == (a.blocks[1], blocks[1]) and blocks[1] != a.blocks[1]
    bm.free_blocks(a.blocks)
    bm.free_blocks(blocks)
    assert bm.num_used == 0


def test_a_freed_block_without_a_cached_prefix_is_handed_out_again_before_an_unused_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))  # two full blocks (registered) and a partial one
    a = bm.allocate_prompt(prompt, use_cache=True)
    assert a is not None and a.blocks == [0, 1, 2]  # never-used blocks in order
    bm.register_full_blocks(prompt, a.blocks, len(prompt))
    decoded = [bm.append_block() for _ in range(2)]  # a decode's blocks: never registered
    assert decoded == [3, 4]
    bm.free_blocks(a.blocks + decoded)
    # the unregistered blocks come back last freed first (a sequence's are freed tail first), then the unused ones;
    # the cached prefix (0, 1) goes last, and is still found meanwhile
    assert [bm.append_block() for _ in range(4)] == [2, 3, 4, 5]
    again = bm.allocate_prompt(prompt, use_cache=True)
    assert again is not None and again.blocks[:2] == [0, 1] and again.num_cached_tokens == 8
    assert again.blocks[2] == 6 and bm.append_block() == 7
    assert bm.num_free == 0 and not bm.can_append()


def test_every_free_block_without_a_cached_prefix_goes_before_any_cached_one_is_evicted() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    for first in (0, 100):  # two prompts of two full blocks each, all four blocks cached once freed
        prompt = list(range(first, first + 5))
        alloc = bm.allocate_prompt(prompt, use_cache=True)
        assert alloc is not None
        bm.register_full_blocks(prompt, alloc.blocks, len(prompt))
        bm.free_blocks(alloc.blocks)
    # the second prompt took the first's partial block (2) again, then two unused ones
    assert sorted(bm.block_to_hash) == [0, 1, 2, 3]
    taken = [bm.append_block() for _ in range(6)]
    # its partial block (4), the last unused one (5), then the cached blocks oldest freed first, a prompt's tail first
    assert taken == [4, 5, 1, 0, 3, 2]
    assert bm.hash_to_block == {} and bm.block_to_hash == {}


def test_prefix_keys_are_sha256_of_the_chain() -> None:
    """The key that decides KV reuse is a cryptographic hash of the parent key and the block's ids: no client can
    make two different prefixes collide."""
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    a = bm.allocate_prompt(prompt, use_cache=True)
    assert a is not None
    bm.register_full_blocks(prompt, a.blocks, len(prompt))
    first = hashlib.sha256(array("q", prompt[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", prompt[4:8]).tobytes()).digest()
    assert bm.block_to_hash == {a.blocks[0]: first, a.blocks[1]: second}


def test_cache_salt_separates_prefixes() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    a = bm.allocate_prompt(prompt, True, PrefixHashes("tenant-a"))
    assert a is not None
    bm.register_full_blocks(prompt, a.blocks, len(prompt), PrefixHashes("tenant-a"))
    for salt in (None, "tenant-b"):
        other = bm.allocate_prompt(prompt, True, PrefixHashes(salt))
        assert other is not None and other.num_cached_tokens == 0
        bm.free_blocks(other.blocks)
    same = bm.allocate_prompt(prompt, True, PrefixHashes("tenant-a"))
    assert same is not None and same.num_cached_tokens == 12 and same.blocks[:3] == a.blocks[:3]


def test_an_8bit_cache_is_refused_for_heads_it_cannot_cut_in_blocks_of_32() -> None:
    from tests.engine.tiny import tiny_core
    from tokenmill.engine.kv_cache import KVCacheFormatError

    with pytest.raises(KVCacheFormatError, match="multiple of 32 values; this model's are 16"):
        tiny_core(kv_cache_dtype="int8")  # the tiny model's heads are 16 wide


def test_keys_whose_python_hash_collides_are_still_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup's fast path is Python's hash() of the key; keys that collide there are compared whole, so a prefix
    never finds another prefix's blocks."""

    class Colliding(bytes):
        def __hash__(self) -> int:
            return 0

    real = kv_cache.block_hash
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens: Colliding(real(parent, tokens)))
    bm = BlockManager(num_blocks=8, block_size=4)
    first = list(range(9))
    a = bm.allocate_prompt(first, use_cache=True)
    assert a is not None
    bm.register_full_blocks(first, a.blocks, len(first))
    bm.free_blocks(a.blocks)
    other = bm.allocate_prompt(list(range(100, 109)), use_cache=True)
    assert other is not None and other.num_cached_tokens == 0
    bm.free_blocks(other.blocks)
    again = bm.allocate_prompt(first, use_cache=True)
    assert again is not None and again.num_cached_tokens == 8 and again.blocks[:2] == a.blocks[:2]
