"""The shared store behind draftless speculation's `suffix` method: drafts from the finished requests of the same
tenant, where prompt lookup (engine/speculation.py) finds them only in the sequence's own tokens.

Requests repeat each other: templated documents, retries, edits of the same files. So the tokens of each finished
request (prompt and output, one document) are kept, and a sequence whose last tokens occurred in a document gets as its
draft the tokens that followed there. Among the `max_matches` most recent occurrences of the longest suffix of the
sequence that matches (`max_ngram` tokens down to `min_ngram`), the draft grows one token at a time: the token most
occurrences continue with, for as long as it keeps at least `min_share` of the occurrences still live, so text that
forked in the past drafts only up to the fork.

The index. Each document takes a range of addresses in one address space that only grows, so an address names a
document and a position in it, and a later document has higher addresses. Per tenant, a dict maps each run of
`min_ngram` tokens (the bytes of their 32-bit ids: less than half the memory of a tuple) to the addresses where it
begins, ascending, in an `array` of 64-bit ints (8 bytes an occurrence). A lookup reads the addresses of the
sequence's last `min_ngram` tokens, newest first, and checks longer matches by comparing tokens backward; it never
scans the documents. An add appends one address per n-gram: O(document length).

Tenants. A tenant is an opaque string (a hash of the client's API key). A lookup reads its own tenant's index and
PUBLIC's, the operator's warm corpus, and nothing else, so one client's text is never drafted into another's output
(a draft is only checked by the model, never shown, but it would still let timing tell what another client wrote).

Memory. The tokens of all documents together never exceed `max_tokens`: an add that would pass it first evicts the
least recently used documents (used: added, or drawn from by a proposal), and removes their addresses from the index,
by bisection since each array is sorted, so the memory falls with them. `nbytes()` is kept up to date on every change,
so reading it costs O(tenants).
"""

from __future__ import annotations

import heapq
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

PUBLIC = ""  # the tenant of the warm corpus: every tenant's lookups also read it
# A common n-gram can occur thousands of times: the longest match is looked for among its most recent occurrences
# only, this many per match kept, so a lookup costs O(max_matches) however large the store grows.
SCAN_PER_MATCH = 4


@dataclass(slots=True, eq=False)
class _Document:
    tenant: str
    start: int  # the address of its first token
    tokens: array[int]  # 32-bit token ids: half the memory of 64-bit ones, and vocabularies are far smaller
    digest: int  # hash of the tokens, to find an identical document of the same tenant

    @property
    def nbytes(self) -> int:
        """The document and its entries in the store's tables (an LRU slot, a start, a dedupe key)."""
        key = (self.tenant, self.digest)
        return (
            sys.getsizeof(self)
            + sys.getsizeof(self.tokens)
            + sys.getsizeof(self.start)
            + sys.getsizeof(key)
            + sys.getsizeof(self.digest)
        )


class SuffixStore:
    """Finished token sequences per tenant, and drafts drawn from them. Not thread-safe: one engine thread owns it."""

    def __init__(
        self,
        max_tokens: int,
        min_ngram: int = 2,
        max_ngram: int = 4,
        max_matches: int = 64,
        min_share: float = 0.5,
    ) -> None:
        if max_tokens < 0 or not 1 <= min_ngram <= max_ngram or max_matches < 1 or not 0.0 <= min_share <= 1.0:
            raise ValueError("need max_tokens >= 0, 1 <= min_ngram <= max_ngram, max_matches >= 1, 0 <= min_share <= 1")
        self.max_tokens = max_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_matches = max_matches
        self.min_share = min_share
        self._docs: OrderedDict[int, _Document] = OrderedDict()  # by start, least recently used first
        self._starts: list[int] = []  # the documents' starts, ascending: an address's document by bisection
        self._index: dict[str, dict[bytes, array[int]]] = {}  # tenant → n-gram → addresses, ascending
        self._seen: dict[tuple[str, int], int] = {}  # (tenant, digest) → start
        self._next_start = 0
        self._tokens = 0
        self._doc_bytes = 0
        self._index_bytes = 0  # the index's keys and arrays; the dicts' own tables are measured when asked

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def documents(self) -> int:
        return len(self._docs)

    def nbytes(self) -> int:
        """The memory the store holds, documents and index, as sys.getsizeof counts it."""
        tables = sum(sys.getsizeof(index) for index in self._index.values())
        for table in (self._docs, self._starts, self._index, self._seen):
            tables += sys.getsizeof(table)
        return self._doc_bytes + self._index_bytes + tables

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Keep a finished sequence's tokens (its last max_tokens of them) under `tenant`."""
        kept = array("i", tokens[max(0, len(tokens) - self.max_tokens) :])
        if len(kept) <= self.min_ngram:
            return  # no n-gram with a token after it: nothing to draft from
        digest = hash(kept.tobytes())
        held = self._docs.get(self._seen.get((tenant, digest), -1))
        if held is not None and held.tokens == kept:
            self._docs.move_to_end(held.start)
            return
        while self._tokens + len(kept) > self.max_tokens:
            self._evict(next(iter(self._docs.values())))
        doc = _Document(tenant, self._next_start, kept, digest)
        self._next_start += len(kept)
        self._docs[doc.start] = doc
        self._starts.append(doc.start)
        self._seen[(tenant, digest)] = doc.start
        self._tokens += len(kept)
        self._doc_bytes += doc.nbytes
        self._index_document(doc)

    def propose(self, tenant: str, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `context` in the tenant's and PUBLIC's documents, token
        by token the majority continuation; [] where no suffix of at least min_ngram tokens occurs."""
        if k <= 0 or len(context) < self.min_ngram:
            return []
        live = self._matches(tenant, context)
        draft: list[int] = []
        while len(draft) < k:
            live = [(doc, at) for doc, at in live if at < len(doc.tokens)]
            token = self._majority(live)
            if token is None:
                break
            draft.append(token)
            live = [(doc, at + 1) for doc, at in live if doc.tokens[at] == token]
            if len(draft) == 1:
                for doc, _ in reversed(live):  # drawn from, so used: the newest last, as the most recently used
                    self._docs.move_to_end(doc.start)
        return draft

    def _matches(self, tenant: str, context: Sequence[int]) -> list[tuple[_Document, int]]:
        """The occurrences of the longest matching suffix, newest first, as (document, where the next token is)."""
        key = array("i", context[-self.min_ngram :]).tobytes()
        scan = SCAN_PER_MATCH * self.max_matches
        found = [index[key] for t in {tenant, PUBLIC} if (index := self._index.get(t)) is not None and key in index]
        newest = heapq.merge(*(reversed(addresses[-scan:]) for addresses in found), reverse=True)
        matches: list[tuple[_Document, int]] = []
        best = 0
        for address in islice(newest, scan):
            doc = self._docs[self._starts[bisect_right(self._starts, address) - 1]]
            at = address - doc.start
            n = self._match_length(doc.tokens, at, context)
            if n > best:
                best, matches = n, []
            if n == best and len(matches) < self.max_matches:
                matches.append((doc, at + self.min_ngram))
                if best == self.max_ngram and len(matches) == self.max_matches:
                    break  # no longer match can turn up, nor a newer one of this length
        return matches

    def _match_length(self, tokens: array[int], at: int, context: Sequence[int]) -> int:
        """How many tokens of context end where the n-gram at `at` ends: min_ngram to max_ngram."""
        m = self.min_ngram
        n, most = m, min(self.max_ngram, at + m, len(context))
        while n < most and tokens[at + m - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def _majority(self, live: list[tuple[_Document, int]]) -> int | None:
        """The token most live occurrences continue with (a tie: the newest's), if it has min_share of them."""
        if not live:
            return None
        counts: dict[int, int] = {}
        for doc, at in live:  # newest first, so max() below breaks ties toward the newest document
            token = doc.tokens[at]
            counts[token] = counts.get(token, 0) + 1
        token = max(counts, key=counts.__getitem__)
        return token if counts[token] >= self.min_share * len(live) else None

    def _index_document(self, doc: _Document) -> None:
        index = self._index.setdefault(doc.tenant, {})
        m, tokens = self.min_ngram, doc.tokens
        for at in range(len(tokens) - m):  # the last n-gram has nothing after it to draft
            key = tokens[at : at + m].tobytes()
            addresses = index.get(key)
            if addresses is None:
                addresses = index[key] = array("q")
                self._index_bytes += sys.getsizeof(key) + sys.getsizeof(addresses)
            before = sys.getsizeof(addresses)
            addresses.append(doc.start + at)
            self._index_bytes += sys.getsizeof(addresses) - before

    def _evict(self, doc: _Document) -> None:
        index = self._index[doc.tenant]
        m, tokens, end = self.min_ngram, doc.tokens, doc.start + len(doc.tokens)
        for at in range(len(tokens) - m):
            key = tokens[at : at + m].tobytes()
            addresses = index.get(key)
            if addresses is None:
                continue  # an n-gram the document repeats, its key already gone
            before = sys.getsizeof(addresses)
            # The document's addresses are one contiguous run of the sorted array.
            del addresses[bisect_left(addresses, doc.start) : bisect_left(addresses, end)]
            self._index_bytes += sys.getsizeof(addresses) - before
            if not addresses:
                del index[key]
                self._index_bytes -= sys.getsizeof(key) + sys.getsizeof(addresses)
        if not index:
            del self._index[doc.tenant]
        del self._docs[doc.start]
        del self._starts[bisect_left(self._starts, doc.start)]
        if self._seen.get((doc.tenant, doc.digest)) == doc.start:
            del self._seen[(doc.tenant, doc.digest)]
        self._tokens -= len(tokens)
        self._doc_bytes -= doc.nbytes
