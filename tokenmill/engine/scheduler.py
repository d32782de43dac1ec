"""Continuous batching: each step decodes the running set and fills the rest of a token budget with prefill chunks.

Running sequences go first, oldest first, one token each (or the next chunk of an unfinished prefill). Waiting
sequences are admitted in arrival order while their prompt's blocks fit, the budget lasts and fewer than
`max_num_prefills` prompts are being prefilled in the step; a long prompt is prefilled in chunks across steps while
others keep decoding. When a running sequence needs a new block and none is free, the youngest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.

Why a cap on prompts per step: a burst of prompts prefilled in one step gives every one of them its first token at
the end of that long step, and every running stream waits as long for its next token. Taken a few prompts a step,
in arrival order, the first ones get their first token after a short step, the running streams keep flowing, and the
last ones wait about as long as before: the same work, in steps that each stream the weights once more (the LM head
whole, the layers at fewer rows). Mean time to first token falls; the last prompt's rises by those extra passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.engine.kv_cache import BlockManager
from tokenmill.engine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step, starting at seq.num_computed_tokens


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_num_prefills: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefills = max_num_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted to make room for an older sequence
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve_slots(seq, seq.num_computed_tokens + n):
                continue
            scheduled.append(Scheduled(seq, n))
            budget -= n
        prefills = sum(1 for s in scheduled if s.seq.num_computed_tokens < s.seq.num_tokens - 1)  # chunked prompts
        while self.waiting and budget > 0 and self._has_room_for(self.waiting[0]) and prefills < self.max_num_prefills:
            seq = self.waiting[0]
            alloc = self.blocks.allocate_prompt(seq.token_ids, not seq.wants_prompt_logprobs, seq.prefix)
            if alloc is None:
                break
            self.waiting.popleft()
            seq.block_table = alloc.blocks
            seq.num_computed_tokens = alloc.num_cached_tokens
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = alloc.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(Scheduled(seq, n))
            budget -= n
            prefills += 1
        return scheduled

    def _has_room_for(self, seq: Sequence) -> bool:
        return not self.running or len(self.running) + seq.params.n <= self.max_num_seqs

    def _reserve_slots(self, seq: Sequence, num_slots: int) -> bool:
        """Grow seq's block table to hold num_slots tokens, preempting younger sequences if needed."""
        while len(seq.block_table) < self.blocks.blocks_needed(num_slots):
            if not self.blocks.can_append():
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(self.blocks.append_block())
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
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

    def admit_running(self, seq: Sequence) -> None:
        """A forked child that already holds its blocks joins the running set directly."""
        seq.status = Status.RUNNING
        self.running.append(seq)
