"""Draftless speculative decoding: a sequence's next tokens guessed from text it has already seen, and checked by the
model in the same step that computes its next token.

Prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): where the last n tokens of a sequence (n from
`max_ngram` down to `min_ngram`) occurred earlier in it, prompt or output, the tokens that followed their most recent
earlier occurrence are the draft. A decode row with a draft of d tokens becomes a chunk of 1 + d rows, like a prompt
chunk over the paged cache: one pass over the weights scores them all. Its rows are sampled in order, each as the plain
decode step would sample it (the same logits bit for bit, by batch invariance: docs/decisions/0001-batch-invariance.md),
and the draft is kept for as long as it agrees with what was sampled; the first disagreement is itself the right next
token. A sampled sequence draws from its own generator once per token, in order, as it does without a draft, so a
draft token is kept with the probability the model gives it (what the standard rejection rule gives a draft that is
one token for sure) and the draws are the same. So a sequence emits exactly the tokens, logprobs and text it emits
without speculation, seed for seed, 1 to d + 1 of them a step.

When it pays: a decode step on a CPU is bound by reading the weights, so a few more rows cost little while the batch is
small; a wrong draft costs the extra rows (and, for a lone greedy row, the LM head's quick pass: gguf_greedy_row). So
drafts are made only in steps of at most `max_rows` decode rows and no prompt chunk, a step's rows share at most
`step_tokens` draft tokens, and a sequence whose draft missed entirely waits before its next, twice as long after each
miss in a row (docs/decisions/0037-draftless-speculation.md has the measurements).

Method `suffix` adds a store shared by the requests of a tenant (suffix_store.py): the tokens of every finished
sequence are kept, bounded and least recently used first out, and a sequence whose own tokens give no draft gets one
from the text that followed its last tokens in its tenant's earlier requests (or in the operator's corpus file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.engine.suffix_store import PUBLIC, SuffixStore
from tokenmill.tokenizer import Tokenizer

CORPUS_DOCUMENT = 2048  # tokens of a corpus file each document of the store takes: a lookup draws within one

MAX_PAUSE = 32  # steps a sequence waits for its next draft after misses in a row, at most


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"
    num_tokens: int = 4  # most draft tokens a row gets
    min_ngram: int = 2
    max_ngram: int = 4
    max_rows: int = 4  # drafts only in steps of at most this many decode rows
    step_tokens: int = 8  # draft tokens in one step, at most: shared between its rows
    # method "suffix": where a sequence's own tokens give no draft, the finished requests of its tenant may
    store_tokens: int = 250_000  # tokens the shared store keeps, all tenants together (suffix_store.py)
    min_share: float = 0.5  # a store draft goes on while its token follows in this share of the matches, at least
    corpus: str | None = None  # a text file read into the store at start, for every tenant

    @property
    def shared(self) -> bool:
        return self.enabled and self.method == "suffix"

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.num_tokens > 0


@dataclass
class DraftState:
    """One sequence's lookup index and how its drafts fared."""

    positions: dict[int, list[int]] = field(default_factory=dict)  # token → where it occurs, ascending
    indexed: int = 0  # tokens of the sequence in `positions`
    pause: int = 0  # steps to wait before the next draft
    misses: int = 0  # drafts in a row that kept nothing

    def index(self, tokens: list[int]) -> None:
        for at in range(self.indexed, len(tokens)):
            self.positions.setdefault(tokens[at], []).append(at)
        self.indexed = len(tokens)

    def settle(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens kept `accepted` of them."""
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.pause = min(MAX_PAUSE, 1 << (self.misses - 1))


def propose(tokens: list[int], state: DraftState, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (at least
    min_n, at most max_n long) that occurred before; [] where none did."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    state.index(tokens)
    last = len(tokens) - 1
    best_n, best_at = 0, -1
    for at in reversed(state.positions.get(tokens[last], ())):
        if at >= last:
            continue  # the suffix itself
        n = 1
        while n < max_n and at - n >= 0 and tokens[at - n] == tokens[last - n]:
            n += 1
        if n > best_n:
            best_n, best_at = n, at
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return tokens[best_at + 1 : best_at + 1 + k]


def shared_store(config: SpeculativeConfig, tokenizer: Tokenizer) -> SuffixStore | None:
    """The store of method "suffix", with the corpus file's text in it for every tenant; None for other methods."""
    if not config.shared:
        return None
    store = SuffixStore(config.store_tokens, config.min_ngram, config.max_ngram, min_share=config.min_share)
    if config.corpus is not None:
        ids = tokenizer.encode(Path(config.corpus).read_text(encoding="utf-8"), add_special_tokens=False)
        for start in range(0, len(ids), CORPUS_DOCUMENT):
            store.add(PUBLIC, ids[start : start + CORPUS_DOCUMENT])
    return store
