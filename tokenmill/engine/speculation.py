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

When it pays: a decode step costs a fixed part (reading the weights, the Python around the kernels) and a part per row
(the rows' arithmetic, above all the LM head's over the whole vocabulary), and a draft token is one more row that
pays off only if it is kept. StepCost fits the two parts to the decode steps the engine has run, and plan() checks a
draft token only where the chance that it is kept (the sequence's running rate of kept draft tokens, to the power of
its place in the draft) is above the tokens per row's worth of time the step makes without it: many tokens while the
fixed part dominates (a few rows), none once the rows' arithmetic does (many rows of a small model) or the drafts
miss. A sequence whose draft missed entirely also waits before its next, twice as long after each miss in a row, and
no draft is made in a step with a prompt chunk or more than `max_rows` decode rows (served, 16 clients ran slower
with the drafts the fit allowed them) (docs/decisions/0037-draftless-speculation.md and
0038-speculation-by-step-cost.md have the measurements). Nor may drafts make any stream slower: a stream whose text
repeats nothing, beside streams that copy theirs, would otherwise make one token a step at the pace of their longer
steps, so a step grows only as far as each of its rows' own tokens (this step's draft, or what its drafts kept
lately) pay for (docs/decisions/0044-speculation-on-by-default.md).

A stream under a grammar (structured outputs) drafts the text its grammar allows alone from where it stands, else
its lookup's draft cut where the grammar refuses it (guided.py): each kept token is still sampled under its mask.

Method `suffix` adds a store shared by the requests of a tenant (suffix_store.py): the tokens of every finished
sequence are kept, bounded and least recently used first out, and a sequence whose own tokens give no draft gets one
from the text that followed its last tokens in its tenant's earlier requests (or in the operator's corpus file).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from tokenmill.engine.suffix_store import PUBLIC, SuffixStore
from tokenmill.tokenizer import Tokenizer

CORPUS_DOCUMENT = 2048  # tokens of a corpus file each document of the store takes: a lookup draws within one

MAX_PAUSE = 32  # steps a sequence waits for its next draft after misses in a row, at most
MAX_SCAN = 64  # earlier occurrences of a sequence's last token a lookup looks at, latest first
FIRST_RATE, PRIOR_TOKENS = 0.75, 4.0  # a new sequence's rate of kept draft tokens, before its own drafts
KEPT_DECAY = 0.9  # the weight of a sequence's earlier drafts in its rate of kept tokens falls by this a draft
MAX_FIXED_ROWS = 1000.0  # a step's fixed part in rows, at most: where rows cost nothing measurable
# what a draft token must make beyond paying for its row: checking a draft costs a sampler call per position, which
# the fit sees only in the drafted steps it has timed, and a fit over a few row counts is noisy
MARGIN = 0.15
# one step in this many checks one draft token even where the plan says it would not pay: a step count's time is
# measured only when it runs, and a slow step must not stop drafts for good
EXPLORE_EVERY = 32
# how much longer a drafted step may take than the same step without drafts, per token a row expects of the step
# (plan): no stream's tokens per second fall, in expectation, by more than this because of the drafts of the streams
# beside it; 5%, about the spread of one row count's step times
MAX_SLOWDOWN = 1.05
CREDIT_DECAY = 0.8  # the weight of a sequence's earlier steps in its credit (DraftState.credit) falls by this a step


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"
    num_tokens: int = 16  # most draft tokens a row gets (the plan checks as many of them as pay)
    min_ngram: int = 2
    max_ngram: int = 4
    step_tokens: int = 16  # draft tokens in one step, at most
    max_rows: int = 8  # no drafts in a step of more decode rows than this, whatever the step cost says
    fixed_rows: float = 4.0  # a step's fixed part in rows' worth of time, until StepCost has measured it
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
    # draft tokens kept, and tokens tried up to and including each draft's first miss, both decaying with each
    # draft: their ratio is the chance the next draft token is kept (a kept run ends at the first miss). A new
    # sequence starts from the engine's recent rate, hopefully: at least FIRST_RATE, worth PRIOR_TOKENS tokens tried
    kept: float = 3.0
    tried: float = 4.0
    # the tokens its drafts kept a step lately: an average over its recent decode steps, drafted or not, decaying by
    # CREDIT_DECAY a step. A stream that drafts well has its speed from them, and may wait in a step beside others'
    # drafts without one of its own; a stream whose text repeats nothing has none (plan's bound)
    credit: float = 0.0
    # all its drafts, undecayed: what /stats reports of the sequence once it ends
    total_drafts: int = 0
    total_drafted: int = 0
    total_kept: int = 0

    @classmethod
    def starting(cls, recent: float) -> DraftState:
        rate = max(recent, FIRST_RATE)
        return cls(kept=rate * PRIOR_TOKENS, tried=PRIOR_TOKENS)

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def index(self, tokens: list[int]) -> None:
        for at in range(self.indexed, len(tokens)):
            self.positions.setdefault(tokens[at], []).append(at)
        self.indexed = len(tokens)

    def step(self) -> None:
        """One more decode step of the sequence's with drafts weighed (its draft, if any, settles after)."""
        self.credit *= CREDIT_DECAY

    def settle(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens kept `accepted` of them."""
        self.credit += (1 - CREDIT_DECAY) * accepted
        self.total_drafts += 1
        self.total_drafted += drafted
        self.total_kept += accepted
        self.kept = KEPT_DECAY * self.kept + accepted
        self.tried = KEPT_DECAY * self.tried + accepted + (accepted < drafted)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.pause = min(MAX_PAUSE, 1 << (self.misses - 1))


class StepCost:
    """What a decode step of n rows takes, per n: each row count's seconds, a running mean whose earlier steps weigh
    less and less (the machine drifts). A step's time is flat in its rows while reading the weights bounds it and
    grows with them once their arithmetic does, so the fixed part a draft is weighed against is fitted locally: a
    line through the row counts from half to twice the step's, weighted by how often each was seen. Where fewer than
    two of them were seen, small steps (up to the prior's rows) take the prior, and larger ones a fixed part of
    none: no draft where nothing says it pays."""

    def __init__(self, prior_rows: float, decay: float = 0.98) -> None:
        self.prior_rows = prior_rows
        self.decay = decay
        self.seconds: dict[int, float] = {}  # rows → the running mean of its steps' seconds
        self.weight: dict[int, float] = {}  # rows → its steps' weight in that mean (decayed count)

    def observe(self, rows: int, seconds: float) -> None:
        weight = self.decay * self.weight.get(rows, 0.0) + 1.0
        mean = self.seconds.get(rows, seconds)
        self.seconds[rows] = mean + (seconds - mean) / weight
        self.weight[rows] = weight

    def seconds_at(self, rows: int) -> float | None:
        """What a step of `rows` rows takes: its own running mean where seen, else a line between the nearest row
        counts seen on either side; None beyond them."""
        if self.weight.get(rows, 0.0) >= 1.0:
            return self.seconds[rows]
        seen = sorted(n for n in self.seconds if self.weight[n] >= 1.0)
        below, above = [n for n in seen if n < rows], [n for n in seen if n > rows]
        if not below or not above:
            return None
        a, b = below[-1], above[0]
        return self.seconds[a] + (self.seconds[b] - self.seconds[a]) * (rows - a) / (b - a)

    def fixed_rows(self, rows: int) -> float:
        """The fixed part of a step of `rows` rows, in rows' worth of time: how many rows it could add before its
        time doubled."""
        seen = [n for n in self.seconds if rows / 2 <= n <= 2 * rows and self.weight[n] >= 1.0]
        if len(seen) < 2:
            return self.prior_rows if rows <= self.prior_rows else 0.0
        w = sum(self.weight[n] for n in seen)
        mean_x = sum(self.weight[n] * n for n in seen) / w
        mean_y = sum(self.weight[n] * self.seconds[n] for n in seen) / w
        spread = sum(self.weight[n] * (n - mean_x) ** 2 for n in seen) / w
        per_row = sum(self.weight[n] * (n - mean_x) * (self.seconds[n] - mean_y) for n in seen) / w / spread
        if per_row <= 0:
            return MAX_FIXED_ROWS  # rows cost nothing measurable here: the fixed part is all there is
        return min(max((mean_y - per_row * mean_x) / per_row, 0.0), MAX_FIXED_ROWS)


def plan(
    rates: list[float],
    lengths: list[int],
    fixed_rows: float,
    budget: int,
    credits: list[float] | None = None,
    seconds_at: Callable[[int], float | None] | None = None,
    max_slowdown: float = MAX_SLOWDOWN,
) -> list[int]:
    """How many of each row's draft tokens to check (rows in the step without drafts: len(rates)).

    The j-th token of a draft (j from 1) is kept with chance rate^j, as a kept run ends at its first miss. With F the
    fixed part in rows and N the rows so far, a step making E tokens makes E / (F + N) per row's worth of time; one
    more row making v tokens raises that exactly when v > E / (F + N). So tokens are added, likeliest first, while
    v beats that by MARGIN, at most `budget` of them.

    And no row may lose: each row's tokens per time may fall to no less than 1 / `max_slowdown` of what the step
    without drafts gives it. A row expecting g more tokens from its own draft, or making g more a step lately
    (`credits`: DraftState.credit), bounds the step's time to max_slowdown × (1 + g) times the undrafted step's. So a
    stream whose text repeats nothing keeps the drafts beside it out of its steps (but for max_slowdown), while streams
    that draft well, this step or lately, are bounded by the throughput rule alone. The two steps' times are those
    measured (`seconds_at`: StepCost.seconds_at) where known, for a line fitted near a few rows says little of a step
    of many more (with AMX, rows past 16 take a second tile's work)."""
    n = len(rates)
    rows = emitted = float(n)
    added: list[tuple[int, float]] = []  # (row, the chance its token is kept), likeliest first
    frontier = [(-rate, i) for i, rate in enumerate(rates) if lengths[i] > 0]
    heapq.heapify(frontier)
    taken = [0] * n
    while frontier and budget > 0:
        value, i = heapq.heappop(frontier)
        value = -value
        if value <= (1 + MARGIN) * emitted / (fixed_rows + rows):
            break
        added.append((i, value))
        taken[i] += 1
        rows, emitted, budget = rows + 1, emitted + value, budget - 1
        if taken[i] < lengths[i]:
            heapq.heappush(frontier, (-value * rates[i], i))
    # the longest run of those tokens under which no row loses; none at all always qualifies
    undrafted = seconds_at(n) if seconds_at is not None else None
    credits = credits or [0.0] * n
    gains = [0.0] * n
    longest = 0
    for count, (i, value) in enumerate(added, start=1):
        gains[i] += value
        drafted = seconds_at(n + count) if seconds_at is not None and undrafted else None
        slower = drafted / undrafted if undrafted and drafted else (fixed_rows + n + count) / (fixed_rows + n)
        if slower <= max_slowdown * min(1 + max(gain, credit) for gain, credit in zip(gains, credits)):
            longest = count
    taken = [0] * n
    for i, _ in added[:longest]:
        taken[i] += 1
    return taken


def propose(tokens: list[int], state: DraftState, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (at least
    min_n, at most max_n long) that occurred before, preferring one with k tokens after it; [] where none did."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    state.index(tokens)
    last = len(tokens) - 1
    best, best_at = (0, 0), -1
    for at in islice(reversed(state.positions.get(tokens[last], ())), MAX_SCAN):
        if at >= last:
            continue  # the suffix itself
        n = 1
        while n < max_n and at - n >= 0 and tokens[at - n] == tokens[last - n]:
            n += 1
        # the longest match, then the one with the most of k tokens after it: in a run of one token repeated, the
        # latest match has a single token after it, and one k tokens back has k
        score = (n, min(k, last - at))
        if score > best:
            best, best_at = score, at
            if score == (max_n, k):
                break
    if best[0] < min_n:
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
