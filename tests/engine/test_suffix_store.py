"""The suffix store (engine/suffix_store.py): drafts from finished sequences of the same tenant and the warm corpus,
the majority continuation of the longest match, in bounded memory."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from tokenmill.engine.suffix_store import PUBLIC, SuffixStore


def test_a_single_document_drafts_what_followed() -> None:
    store = SuffixStore(max_tokens=1000)
    store.add("a", [1, 2, 3, 4, 5, 6, 7])
    assert store.propose("a", [9, 9, 3, 4], k=3) == [5, 6, 7]
    assert store.propose("a", [9, 9, 3, 4], k=2) == [5, 6]
    assert store.propose("a", [5, 6], k=10) == [7]  # the document ends
    assert store.propose("a", [6, 7], k=10) == []  # nothing followed the last n-gram
    assert store.propose("a", [4, 3], k=3) == []


def test_the_longest_match_wins_over_a_newer_shorter_one() -> None:
    store = SuffixStore(max_tokens=1000, min_ngram=2, max_ngram=4)
    store.add("a", [1, 2, 3, 4, 10, 11])
    store.add("a", [7, 8, 3, 4, 20, 21])  # newer, but matches only the last two tokens
    assert store.propose("a", [1, 2, 3, 4], k=2) == [10, 11]
    assert store.propose("a", [8, 3, 4], k=2) == [20, 21]
    assert store.propose("a", [5, 3, 4], k=2) == [20, 21]  # two tokens each: a tie, so the newest


def test_the_majority_continuation_across_documents() -> None:
    store = SuffixStore(max_tokens=1000)
    store.add("a", [1, 2, 3, 4, 5])
    store.add("a", [1, 2, 3, 4, 6])
    store.add("a", [1, 2, 3, 9, 9])
    # After [1, 2]: 3 by all three; after 3: 4 by two of three; then 5 and 6 split the two left, half each.
    assert store.propose("a", [1, 2], k=5) == [3, 4, 6]


def test_a_continuation_under_min_share_ends_the_draft() -> None:
    store = SuffixStore(max_tokens=1000, min_share=0.5)
    for tail in (5, 6, 7):
        store.add("a", [1, 2, 3, 4, tail])
    assert store.propose("a", [1, 2], k=5) == [3, 4]  # a third each for 5, 6 and 7
    strict = SuffixStore(max_tokens=1000, min_share=0.7)
    strict.add("a", [1, 2, 3, 8])
    strict.add("a", [1, 2, 3, 9])
    strict.add("a", [1, 2, 4, 9])
    assert strict.propose("a", [1, 2], k=5) == []  # 3 has two thirds of them


def test_max_matches_keeps_the_most_recent_occurrences() -> None:
    docs = [[1, 2, 5], [7, 1, 2, 5], [6, 1, 2, 5], [8, 1, 2, 6], [9, 1, 2, 6]]
    few, all_ = SuffixStore(max_tokens=1000, max_matches=2), SuffixStore(max_tokens=1000)
    for tokens in docs:
        few.add("a", tokens)
        all_.add("a", tokens)
    assert few.propose("a", [1, 2], k=1) == [6]
    assert all_.propose("a", [1, 2], k=1) == [5]


def test_tenants_read_only_their_own_documents_and_public() -> None:
    store = SuffixStore(max_tokens=1000)
    store.add("alice", [1, 2, 3, 4])
    store.add("bob", [5, 6, 7, 8])
    store.add(PUBLIC, [9, 10, 11, 12])
    assert store.propose("alice", [1, 2], k=2) == [3, 4]
    assert store.propose("bob", [1, 2], k=2) == []
    assert store.propose("carol", [1, 2], k=2) == []
    assert store.propose("alice", [5, 6], k=2) == []
    for tenant in ("alice", "bob", "carol", PUBLIC):
        assert store.propose(tenant, [9, 10], k=2) == [11, 12]
    assert store.propose(PUBLIC, [1, 2], k=2) == []


def test_a_tenant_and_public_vote_together() -> None:
    store = SuffixStore(max_tokens=1000)
    store.add(PUBLIC, [1, 2, 3, 4])
    store.add(PUBLIC, [1, 2, 3, 4, 0])
    store.add("alice", [1, 2, 3, 5])
    for tail in (6, 7, 8, 9):
        store.add("bob", [1, 2, 6, tail])  # would outvote the rest, were bob's documents read
    assert store.propose("alice", [1, 2], k=3) == [3, 4, 0]


def test_an_identical_document_is_kept_once() -> None:
    store = SuffixStore(max_tokens=1000)
    store.add("a", [1, 2, 3, 4])
    before = store.nbytes()
    store.add("a", [1, 2, 3, 4])
    store.add("a", (1, 2, 3, 4))
    assert (store.documents, store.tokens, store.nbytes()) == (1, 4, before)
    store.add("b", [1, 2, 3, 4])  # another tenant's copy is its own
    assert (store.documents, store.tokens) == (2, 8)


def test_the_least_recently_used_documents_go_first() -> None:
    store = SuffixStore(max_tokens=12)
    store.add("a", [1, 2, 3, 4])
    store.add("a", [5, 6, 7, 8])
    store.add("a", [9, 10, 11, 12])
    store.add("a", [1, 2, 3, 4])  # used again: now the newest
    store.add("a", [13, 14, 15, 16])
    assert (store.documents, store.tokens) == (3, 12)
    assert store.propose("a", [5, 6], k=2) == []
    assert store.propose("a", [1, 2], k=2) == [3, 4]
    assert store.propose("a", [9, 10], k=2) == [11, 12]


def test_a_document_drawn_from_outlives_an_older_unused_one() -> None:
    store = SuffixStore(max_tokens=12)
    store.add("a", [1, 2, 3, 4])
    store.add("a", [5, 6, 7, 8])
    store.add("a", [9, 10, 11, 12])
    assert store.propose("a", [1, 2], k=1) == [3]
    store.add("a", [13, 14, 15, 16])
    assert store.propose("a", [5, 6], k=1) == []
    assert store.propose("a", [2, 3], k=1) == [4]
    store.add("a", [17, 18, 19, 20])
    assert store.propose("a", [9, 10], k=1) == []
    assert store.propose("a", [1, 2], k=1) == [3]


def test_eviction_crosses_tenants() -> None:
    store = SuffixStore(max_tokens=8)
    store.add("alice", [1, 2, 3, 4])
    store.add("bob", [5, 6, 7, 8])
    store.add("bob", [9, 10, 11, 12])
    assert store.propose("alice", [1, 2], k=1) == []
    assert store.propose("bob", [5, 6], k=1) == [7]


def test_a_document_longer_than_max_tokens_keeps_its_end() -> None:
    store = SuffixStore(max_tokens=5)
    store.add("a", [1, 2, 3, 4])
    store.add("a", list(range(10, 20)))
    assert (store.documents, store.tokens) == (1, 5)
    assert store.propose("a", [10, 11], k=3) == []
    assert store.propose("a", [14, 15], k=3) == []  # its first kept tokens are 15 to 19
    assert store.propose("a", [15, 16], k=3) == [17, 18, 19]
    assert store.propose("a", [1, 2], k=3) == []


@pytest.mark.parametrize(
    "tokens, context, k",
    [
        ([], [1, 2], 3),
        ([1, 2], [1, 2], 3),  # no token after its only n-gram: not kept
        ([1, 2, 3], [], 3),
        ([1, 2, 3], [2], 3),
        ([1, 2, 3], [1, 2], 0),
        ([1, 2, 3], [1, 2], -1),
    ],
)
def test_empty_and_short_inputs_draft_nothing(tokens: list[int], context: list[int], k: int) -> None:
    store = SuffixStore(max_tokens=100)
    store.add("a", tokens)
    assert store.propose("a", context, k) == []


def test_short_documents_are_not_kept_and_an_empty_store_is_small() -> None:
    store = SuffixStore(max_tokens=100)
    empty = store.nbytes()
    store.add("a", [1, 2])
    assert (store.documents, store.tokens, store.nbytes()) == (0, 0, empty)
    assert SuffixStore(max_tokens=0).propose("a", [1, 2], k=1) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -1},
        {"max_tokens": 10, "min_ngram": 0},
        {"max_tokens": 10, "min_ngram": 3, "max_ngram": 2},
        {"max_tokens": 10, "max_matches": 0},
        {"max_tokens": 10, "min_share": 1.5},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SuffixStore(**kwargs)  # type: ignore[arg-type]


def random_documents(seed: int, count: int, vocab: int = 5000) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    tenants = [PUBLIC, "alice", "bob", "carol"]
    return [(rng.choice(tenants), [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]) for _ in range(count)]


def test_memory_stays_bounded_under_many_adds() -> None:
    docs = random_documents(seed=1, count=2000)
    store = SuffixStore(max_tokens=2000)
    full = 0
    for i, (tenant, tokens) in enumerate(docs):
        store.add(tenant, tokens)
        assert store.tokens <= 2000
        if i < 200:  # the store is full after about 50
            full = max(full, store.nbytes())
        else:
            assert store.nbytes() < 1.2 * full
    early = [(tenant, t) for tenant, t in docs[:50] if len(t) > 2]
    assert early and all(store.propose(tenant, t[:2], k=1) == [] for tenant, t in early)
    tenant, last = next((tenant, t) for tenant, t in reversed(docs) if len(t) > 2)
    assert store.propose(tenant, last[:2], k=1) == [last[2]]


def test_evicting_everything_gives_back_the_index() -> None:
    store = SuffixStore(max_tokens=400)
    empty = store.nbytes()
    for tenant, tokens in random_documents(seed=2, count=300):
        store.add(tenant, tokens)
    store.add("dave", list(range(10_000, 10_400)))  # fills the store alone: all else is evicted
    assert store.documents == 1
    alone = SuffixStore(max_tokens=400)
    alone.add("dave", list(range(10_000, 10_400)))
    # The same contents cost the same, bar the dicts' tables, which keep the size they grew to.
    assert store.nbytes() - empty == pytest.approx(alone.nbytes() - empty, rel=0.05)


@pytest.mark.parametrize("vocab", [50, 5000])  # n-grams that repeat a lot, and hardly at all
def test_nbytes_is_close_to_the_memory_really_held(vocab: int) -> None:
    docs = random_documents(seed=3, count=1000, vocab=vocab)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = SuffixStore(max_tokens=20_000)
        for tenant, tokens in docs:
            store.add(tenant, tokens)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.9 * held < store.nbytes() < 1.1 * held
