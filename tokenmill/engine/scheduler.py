"""Continuous batching: each step decodes the running set and fills the rest of a token budget with prefill chunks,
shared fairly between the requests that have work.

A step holds one-token rows (each running sequence's next token) and prompt chunks: a long prompt is prefilled in
chunks across steps while others keep decoding, and at most `max_num_prefills` prompts are prefilled in one step, a
prompt still in chunked prefill counted. When a running sequence needs a new block and none is free, a sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.

Fairness: every sequence belongs to a group, its request's fairness_key (the edge gives each HTTP request one, so its
prompts and choices are one group) or else its engine request. The prompt slots, the rows that need a grammar mask
(`max_guided_rows`, each mask a pass over the vocabulary) and the token budget are each split max-min fair between
the groups that want them: a group asking for no more than an equal share gets all it asks, the others split the rest.
So one request's 128 prompts or 128 choices cannot hold a later request's few tokens back for more than a step or two
(docs/decisions/0031-fair-scheduling.md). Within a group prompts go in arrival order and rows least recently run first;
where a share does not divide evenly, the group that has waited longest comes first (for prompt slots, after the
groups with a prompt in chunked prefill, so a slot is not taken back from a prompt half done). A group with nothing
running is admitted even when the running set already holds max_num_seqs sequences, and a preemption takes the
youngest sequence of the group that holds the most. What a sequence computes does not depend on which step runs it
(docs/decisions/0001-batch-invariance.md), so none of this changes its tokens.

Why a cap on prompts per step: a burst of prompts prefilled in one step gives every one of them its first token at
the end of that long step, and every running stream waits as long for its next token. Taken a few prompts a step,
in arrival order, the first ones get their first token after a short step, the running streams keep flowing, and the
last ones wait about as long as before: the same work, in steps that each stream the weights once more (the LM head
whole, the layers at fewer rows). Mean time to first token falls; the last prompt's rises by those extra passes.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache import BlockManager
from tokenmill.engine.sequence import Sequence, Status

MAX_GUIDED_ROWS = 8  # rows a step samples under a grammar mask: llguidance walks the whole vocabulary for each


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step, starting at seq.num_computed_tokens
    draft: list[int] = field(default_factory=list)  # guessed tokens after its last one, the step's last rows of it


@dataclass
class _Group:
    """One group's candidates for a step."""

    rows: list[Sequence] = field(default_factory=list)  # running, one token to compute: running order
    in_flight: list[Sequence] = field(default_factory=list)  # running, in chunked prefill: running order
    waiting: list[Sequence] = field(default_factory=list)  # may be admitted now: queue order
    num_running: int = 0
    since: int = 0  # the step its longest-waiting candidate last ran in (or was queued in)
    prompts: list[Sequence] = field(default_factory=list)  # what of in_flight + waiting gets a prompt slot


def group_of(seq: Sequence) -> str:
    return seq.params.fairness_key or seq.request_id


def fair_shares(demands: dict[str, int], capacity: int) -> dict[str, int]:
    """Max-min fair split of `capacity`: a group asking for no more than an equal share of what is left gets all it
    asks, the others split the rest evenly; a remainder that does not divide goes to the first of them (dict order)."""
    shares = dict.fromkeys(demands, 0)
    left, wanting = capacity, [g for g, d in demands.items() if d > 0]
    while wanting and left > 0:
        equal = left // len(wanting)
        if equal == 0:
            for g in wanting[:left]:
                shares[g] += 1
            break
        for g in wanting:
            give = min(equal, demands[g] - shares[g])
            shares[g] += give
            left -= give
        wanting = [g for g in wanting if shares[g] < demands[g]]
    return shares


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_num_prefills: int,
        max_guided_rows: int = MAX_GUIDED_ROWS,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefills = max_num_prefills
        self.max_guided_rows = max_guided_rows
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.num_preemptions = 0
        self.num_steps = 0
        self._last_run: dict[int, int] = {}  # seq_id → the step it last ran in, or was queued in

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._last_run.setdefault(seq.seq_id, self.num_steps)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        self.num_steps += 1
        groups = self._groups()
        order = sorted(groups, key=lambda g: groups[g].since)  # longest waiting first; stable: running order
        in_flight_first = sorted(order, key=lambda g: not groups[g].in_flight)
        wanted = {g: len(groups[g].in_flight) + len(groups[g].waiting) for g in in_flight_first}
        slots = fair_shares({g: min(n, self.max_num_prefills) for g, n in wanted.items()}, self.max_num_prefills)
        guided = {g: sum(1 for s in groups[g].rows if s.guided is not None) for g in order}
        masks = fair_shares(guided, self.max_guided_rows)
        demand: dict[str, int] = {}
        for g in order:
            group = groups[g]
            group.rows = self._rows_to_run(group.rows, masks[g])
            group.prompts = (group.in_flight + group.waiting)[: slots[g]]
            demand[g] = len(group.rows) + sum(s.num_tokens - s.num_computed_tokens for s in group.prompts)
        shares = fair_shares(demand, self.max_num_batched_tokens)
        taken: set[int] = set()
        scheduled = self._schedule_rows(groups, shares, taken)
        for g in order:
            scheduled += self._schedule_prompts(groups[g], shares[g], groups, taken)
        for s in scheduled:
            self._last_run[s.seq.seq_id] = self.num_steps
        return scheduled

    def _groups(self) -> dict[str, _Group]:
        groups: dict[str, _Group] = {}
        for seq in self.running:
            group = groups.setdefault(group_of(seq), _Group(since=self.num_steps))
            group.num_running += 1
            left = seq.num_tokens - seq.num_computed_tokens
            if left <= 0:
                continue
            (group.rows if left == 1 else group.in_flight).append(seq)
            group.since = min(group.since, self._last_run.get(seq.seq_id, self.num_steps))
        for seq in self.waiting:
            group = groups.setdefault(group_of(seq), _Group(since=self.num_steps))
            if len(group.waiting) < self.max_num_prefills and self._has_room_for(seq, group):
                group.waiting.append(seq)
                group.since = min(group.since, self._last_run.get(seq.seq_id, self.num_steps))
        return groups

    def _rows_to_run(self, rows: list[Sequence], masks: int) -> list[Sequence]:
        """A group's one-token rows, least recently run first, with at most `masks` of those under a grammar."""
        kept = []
        for seq in sorted(rows, key=lambda s: self._last_run.get(s.seq_id, self.num_steps)):
            if seq.guided is not None:
                if masks == 0:
                    continue
                masks -= 1
            kept.append(seq)
        return kept

    def _schedule_rows(self, groups: dict[str, _Group], shares: dict[str, int], taken: set[int]) -> list[Scheduled]:
        """Each group's rows within its share of the budget, in running order (the oldest keep their blocks)."""
        chosen: set[int] = set()
        for g, group in groups.items():
            run = group.rows[: shares[g]]
            shares[g] -= len(run)
            chosen.update(s.seq_id for s in run)
        scheduled = []
        for seq in list(self.running):
            if seq.seq_id not in chosen or seq.status is not Status.RUNNING:  # or preempted for an older sequence
                continue
            if not self._reserve_slots(seq, seq.num_tokens, taken):
                continue
            scheduled.append(Scheduled(seq, 1))
            taken.add(seq.seq_id)
        return scheduled

    def _schedule_prompts(
        self, group: _Group, share: int, groups: dict[str, _Group], taken: set[int]
    ) -> list[Scheduled]:
        """The group's prompt chunks within what its share of the budget has left, admitting waiting prompts."""
        scheduled = []
        for seq in group.prompts:
            if share <= 0:
                break
            if seq.status is Status.WAITING and not self._admit(seq, group):
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, share)
            scheduled.append(Scheduled(seq, n))
            taken.add(seq.seq_id)
            share -= n
        return scheduled

    def _admit(self, seq: Sequence, group: _Group) -> bool:
        if not self._has_room_for(seq, group):
            return False
        alloc = self.blocks.allocate_prompt(seq.token_ids, not seq.wants_prompt_logprobs, seq.prefix)
        if alloc is None:
            return False
        self.waiting.remove(seq)
        seq.block_table = alloc.blocks
        seq.num_computed_tokens = alloc.num_cached_tokens
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = alloc.num_cached_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)
        group.num_running += 1
        return True

    def _has_room_for(self, seq: Sequence, group: _Group) -> bool:
        """A group with nothing running gets in however full the running set is: else one request's choices could
        keep every later request out until they end."""
        return not self.running or group.num_running == 0 or len(self.running) + seq.params.n <= self.max_num_seqs

    def _reserve_slots(self, seq: Sequence, num_slots: int, taken: set[int]) -> bool:
        """Grow seq's block table to hold num_slots tokens, preempting others not yet in this step if needed."""
        while len(seq.block_table) < self.blocks.blocks_needed(num_slots):
            if not self.blocks.can_append():
                victim = self._victim(taken)
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(self.blocks.append_block())
        return True

    def reserve_free(self, seq: Sequence, num_slots: int) -> bool:
        """Grow seq's block table to hold num_slots tokens from free blocks alone (a draft is not worth a
        preemption); False where they run out (the blocks taken stay for its next tokens)."""
        while len(seq.block_table) < self.blocks.blocks_needed(num_slots):
            if not self.blocks.can_append():
                return False
            seq.block_table.append(self.blocks.append_block())
        return True

    def _victim(self, taken: set[int]) -> Sequence:
        """The youngest sequence, not yet in this step, of the group that holds the most running sequences."""
        sizes = Counter(group_of(s) for s in self.running)
        free = [s for s in reversed(self.running) if s.seq_id not in taken]
        return max(free, key=lambda s: sizes[group_of(s)])

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = seq.registered_blocks = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free_blocks(seq.block_table)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.block_table = []
        self._last_run.pop(seq.seq_id, None)

    def admit_running(self, seq: Sequence) -> None:
        """A forked child that already holds its blocks joins the running set directly."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._last_run[seq.seq_id] = self.num_steps
