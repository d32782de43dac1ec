"""EngineCore: the synchronous engine. One step reads as schedule → run model → postprocess.

Only the engine's worker thread calls into this class; the async front (engine.py) hands it requests and aborts.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from tokenmill.engine.detok import IncrementalDetokenizer
from tokenmill.engine.kv_cache import BlockManager
from tokenmill.engine.outputs import FinishReason, RequestOutput, SequenceDelta, TokenLogprob
from tokenmill.engine.prompt_logprobs import prompt_logprob_entries
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampled, SampleInput, sample
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduled, Scheduler
from tokenmill.engine.sequence import Sequence
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class EngineStats:
    steps: int = 0
    steps_with_multiple_seqs: int = 0  # proof of batching: steps whose batch held more than one sequence
    max_seqs_in_step: int = 0
    tokens_computed: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0


@dataclass
class RequestState:
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    reported: set[int] = field(default_factory=set)  # seq indices whose finish has been reported
    sent_first: bool = False


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        blocks: BlockManager,
        scheduler: Scheduler,
        eos_ids: set[int],
        max_model_len: int,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.blocks = blocks
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._token_texts: dict[int, str] = {}

    # ---- requests in and out ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        state = RequestState(list(prompt_ids), params)
        self.requests[request_id] = state
        parent = self._new_sequence(request_id, 0, state)
        state.seqs.append(parent)
        if params.max_tokens == 0 and params.prompt_logprobs is None:
            self._finish_without_output(parent)  # nothing to compute: answered on the next step
            return
        self.scheduler.add(parent)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state else []:
            self.scheduler.finish(seq)
            seq.finish(FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch:
            hidden = self.runner.forward(batch)
            self._postprocess(batch, hidden)
            self._count(batch)
        return self._collect_outputs()

    def _postprocess(self, batch: list[Scheduled], hidden: torch.Tensor) -> None:
        to_sample: list[tuple[int, Sequence]] = []  # (row of hidden, sequence)
        row = 0
        for s in batch:
            seq, start = s.seq, s.seq.num_computed_tokens
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens:
                self._add_prompt_logprobs(seq, hidden[row : row + s.num_tokens], start)
            seq.num_computed_tokens += s.num_tokens
            row += s.num_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # mid-prefill: more chunks to go
            self.blocks.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed_tokens)
            if seq.params.max_tokens == 0:
                self._finish_without_output(seq)
                continue
            to_sample.append((row - 1, seq))
            if seq.params.n > 1 and not seq.forked:
                to_sample.extend((row - 1, child) for child in self._fork(seq))
        if to_sample:
            self._sample(to_sample, hidden)

    def _sample(self, to_sample: list[tuple[int, Sequence]], hidden: torch.Tensor) -> None:
        rows = sorted({r for r, _ in to_sample})
        logits = self.runner.logits(hidden[rows])  # (R, V)
        where = {r: i for i, r in enumerate(rows)}
        logits = logits[[where[r] for r, _ in to_sample]]  # (N, V): forked choices share their parent's row
        inputs = [SampleInput(seq.params, seq.generator, seq.output_counts) for _, seq in to_sample]
        for (_, seq), result in zip(to_sample, sample(logits, inputs)):
            self._append(seq, result)

    def _append(self, seq: Sequence, result: Sampled) -> None:
        entry = None
        if seq.params.logprobs is not None:
            top = [(t, self.token_text(t), lp) for t, lp in result.top]
            entry = TokenLogprob(result.token_id, self.token_text(result.token_id), result.logprob, top)
        seq.append_token(result.token_id, result.logprob, entry)
        if result.token_id in self.eos_ids:
            self._finish(seq, FinishReason.STOP)
            return
        seq.pending_text += seq.stop.feed(seq.detok.add(result.token_id))
        if seq.stop.matched:
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if not seq.stop.matched:
            seq.pending_text += seq.stop.feed(seq.detok.flush())
            seq.pending_text += seq.stop.flush()
        if seq.stop.matched:
            reason = FinishReason.STOP
        self.scheduler.finish(seq)
        seq.finish(reason)

    def _finish_without_output(self, parent: Sequence) -> None:
        """max_tokens == 0: every choice ends at once with no tokens (the prompt may still have been scored)."""
        state = self.requests[parent.request_id]
        self._finish(parent, FinishReason.LENGTH)
        for j in range(1, parent.params.n):
            child = self._new_sequence(parent.request_id, j, state)
            child.finish(FinishReason.LENGTH)
            state.seqs.append(child)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Children share the parent's prefilled prompt blocks; the partial last block is copied."""
        state = self.requests[parent.request_id]
        parent.forked = True
        children = []
        for j in range(1, parent.params.n):
            child = self._new_sequence(parent.request_id, j, state)
            child.forked = True
            child.num_cached_tokens = parent.num_cached_tokens
            state.seqs.append(child)
            if self.blocks.num_free == 0:  # no room for a private copy now: recompute later via the prefix cache
                self.scheduler.add(child)
                continue
            child.block_table, copy = self.blocks.fork(parent.block_table, parent.num_computed_tokens)
            if copy is not None:
                self.runner.copy_block(*copy)
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.admit_running(child)
            children.append(child)
        return children

    def _add_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        entries = seq.partial_prompt_logprobs
        del entries[start + 1 :]  # entry p scores position p; a recomputed chunk replaces what it had
        if start == 0:
            entries.clear()
            first = seq.token_ids[0]
            entries.append(TokenLogprob(first, self.token_text(first), None, []))
        entries.extend(
            prompt_logprob_entries(
                self.runner, hidden, seq.token_ids, start, seq.num_prompt_tokens, seq.params.prompt_logprobs or 0,
                self.token_text,
            )
        )
        if len(entries) == seq.num_prompt_tokens:
            seq.prompt_logprobs = entries

    # ---- reporting ----
    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, state in list(self.requests.items()):
            deltas = [d for seq in state.seqs if (d := self._delta(state, seq)) is not None]
            if not deltas:
                continue
            finished = all(s.is_finished for s in state.seqs)
            parent = state.seqs[0]
            out = RequestOutput(request_id, deltas, state.prompt_ids, parent.num_cached_tokens, finished=finished)
            if not state.sent_first:
                out.prompt_logprobs = parent.prompt_logprobs
                state.sent_first = True
            outputs.append(out)
            if finished:
                del self.requests[request_id]
        return outputs

    def _delta(self, state: RequestState, seq: Sequence) -> SequenceDelta | None:
        if seq.index in state.reported or not (seq.pending_ids or seq.pending_text or seq.is_finished):
            return None
        delta = SequenceDelta(
            index=seq.index,
            text=seq.pending_text,
            token_ids=seq.pending_ids,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            cumulative_logprob=seq.cumulative_logprob,
            num_tokens=seq.num_output_tokens,
        )
        seq.pending_text, seq.pending_ids, seq.pending_logprobs = "", [], []
        if seq.is_finished:
            state.reported.add(seq.index)
        return delta

    # ---- helpers ----
    def _new_sequence(self, request_id: str, index: int, state: RequestState) -> Sequence:
        params = state.params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        generator = torch.Generator().manual_seed((seed * _SEED_MIX + index) % (1 << 63))
        detok = IncrementalDetokenizer(self.tokenizer, state.prompt_ids)
        return Sequence(request_id, index, state.prompt_ids, params, detok, generator)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _count(self, batch: list[Scheduled]) -> None:
        st = self.stats
        st.steps += 1
        st.tokens_computed += sum(s.num_tokens for s in batch)
        st.max_seqs_in_step = max(st.max_seqs_in_step, len(batch))
        st.steps_with_multiple_seqs += len(batch) > 1

    def snapshot_stats(self) -> EngineStats:
        st = self.stats
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.num_used_blocks = self.blocks.num_used
        st.num_free_blocks = self.blocks.num_free
        st.num_preemptions = self.scheduler.num_preemptions
        return EngineStats(**vars(st))

