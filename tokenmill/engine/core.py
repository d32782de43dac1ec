"""EngineCore: the synchronous engine. One step reads as schedule → run model → postprocess.

Only the engine's worker thread calls into this class; the async front (engine.py) hands it requests and aborts.
A fault that belongs to one request (non-finite logits in its rows, an exception while sampling, detokenising or
stopping its text) fails that request alone, with an error output; a failed forward pass fails that batch's requests.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.engine.adapters import AdapterRegistry, LoadedAdapter
from tokenmill.engine.guided import GuideError
from tokenmill.engine.kv_cache import BlockManager
from tokenmill.engine.outputs import FinishReason, RequestOutput, StepReport, TokenLogprob
from tokenmill.engine.prompt_logprobs import prompt_logprob_entries
from tokenmill.engine.request import RequestState
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sample_step import gather_logits, greedy_keep, guided_masks, non_finite_rows, sample_rows
from tokenmill.engine.sampler import Sampled, SampleInput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduled, Scheduler
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.speculation import (
    EXPLORE_EVERY,
    MARGIN,
    MAX_FIXED_ROWS,
    DraftState,
    SpeculativeConfig,
    StepCost,
    plan,
    propose,
    shared_store,
)
from tokenmill.model.causal_lm import HeadSummary
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SPEC_RESPONSES = 64  # the finished choices whose drafts /stats lists


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
    weight_bytes_per_token: int = 0  # what one decode step reads of the model's weights (not a counter)
    # speculation (speculation.py), as vLLM counts it: drafts made, their tokens, those kept, kept per position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_store_drafts: int = 0  # of spec_drafts, those from the shared suffix store (method "suffix")
    spec_store_tokens: int = 0  # tokens in the shared suffix store (method "suffix"; not counters)
    spec_store_bytes: int = 0  # the memory they and their index take
    # the last SPEC_RESPONSES choices to end with speculation on, oldest first, each with its own drafts (spec_response)
    spec_responses: list[dict[str, Any]] = field(default_factory=list)
    # the prefix cache's tiers (kv_tiers.TierStats, each name with kv_ before it): sizes now, then counters
    kv_ram_bytes: int = 0
    kv_ram_blocks: int = 0
    kv_ram_capacity_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_disk_blocks: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_ram_hits: int = 0
    kv_disk_hits: int = 0
    kv_ram_saved: int = 0
    kv_disk_written: int = 0
    kv_disk_write_dropped: int = 0
    kv_ram_evictions: int = 0
    kv_disk_evictions: int = 0
    kv_disk_discarded: int = 0
    kv_bytes_to_ram: int = 0
    kv_bytes_from_ram: int = 0
    kv_bytes_to_disk: int = 0
    kv_bytes_from_disk: int = 0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        blocks: BlockManager,
        scheduler: Scheduler,
        eos_ids: set[int],
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.runner = runner
        self.adapters = adapters  # LoRA adapters a request may name (SamplingParams.adapter); None: none can be
        self.tokenizer = tokenizer
        self.blocks = blocks
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.speculative = speculative or SpeculativeConfig()
        self._drafts: dict[int, list[int]] = {}  # this step's drafts: seq_id → its guessed tokens
        self.store = shared_store(self.speculative, tokenizer)  # finished sequences' tokens, per tenant
        self.step_cost = StepCost(self.speculative.fixed_rows)  # what a decode step's rows cost: sizes the drafts
        self._recent = DraftState()  # every sequence's drafts together: a new sequence's first rate of kept tokens
        self._spec_responses: deque[dict[str, Any]] = deque(maxlen=SPEC_RESPONSES)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats(weight_bytes_per_token=runner.model.weight_bytes_per_token())
        self._token_texts: dict[int, str] = {}
        self._failed: list[RequestOutput] = []  # error outputs of requests failed during this step
        self.step_observers: list[Callable[[StepReport], None]] = []  # told of each step that ran a batch

    # ---- requests in and out ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request. One the core cannot take fails alone: its error output comes with the next step."""
        state = RequestState(request_id, list(prompt_ids), params, vocab_size=self.runner.cfg.vocab_size)
        self.requests[request_id] = state
        try:
            state.adapter = self._adapter(params.adapter)
            parent = state.add_sequence(0, self.tokenizer)
            if params.max_tokens == 0 and params.prompt_logprobs is None:
                self._finish_without_output(parent)  # nothing to compute: answered on the next step
            else:
                self.scheduler.add(parent)
        except Exception as exc:
            log.exception("adding request %s failed", request_id)
            self.fail(request_id, _describe(exc))

    def _adapter(self, name: str | None) -> LoadedAdapter | None:
        if name is None:
            return None
        found = self.adapters.get(name) if self.adapters is not None else None
        if found is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        return found

    # ---- adapters (called between steps: AsyncEngine.between_steps) ----
    def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        if self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """KeyError where no adapter has that name."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unload(name, self._slots_in_use())

    def loaded_adapters(self) -> list[LoadedAdapter]:
        return self.adapters.loaded() if self.adapters is not None else []

    def _slots_in_use(self) -> set[int]:
        return {s.adapter.slot for state in self.requests.values() for s in state.seqs if s.adapter is not None}

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state else []:
            self.scheduler.finish(seq)
            seq.finish(FinishReason.ABORT)

    def fail(self, request_id: str, message: str, grammar_failed: bool = False) -> None:
        """End one request with an error (its blocks are freed); the others carry on. `grammar_failed`: its own
        grammar could not go on (guided.GuideError), which the edge answers as the client's fault."""
        state = self.requests.get(request_id)
        if state is None:
            return
        log.error("request %s failed: %s", request_id, message)
        self.abort(request_id)
        self._failed.append(state.error_output(message, grammar_failed))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (a step failed as a whole); returns their error outputs."""
        outputs = []
        for request_id, state in list(self.requests.items()):
            self.abort(request_id)
            outputs.append(state.error_output(message))
        return outputs

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.adapters is not None and self.adapters.retiring:
            self.adapters.release_unused(self._slots_in_use())
        batch = self.scheduler.schedule()
        if batch:
            decoding = self.speculative.enabled and all(_decode_row(s) for s in batch)
            self._drafts = self._draft(batch) if decoding else {}
            hidden = self._forward(batch)
            if hidden is not None:
                self._postprocess(batch, hidden)
            self._count(batch)
            duration_s = time.perf_counter() - started
            if decoding:
                self.step_cost.observe(sum(s.num_tokens for s in batch), duration_s)
            self._report(batch, duration_s)
        failed, self._failed = self._failed, []
        return failed + self._collect_outputs()

    def _forward(self, batch: list[Scheduled]) -> torch.Tensor | None:
        try:
            return self.runner.forward(batch, self._lone_greedy_keep(batch))
        except Exception as exc:  # the batch's KV state is unknown: fail its requests, keep the waiting ones
            log.exception("forward pass failed")
            for request_id in dict.fromkeys(s.seq.request_id for s in batch):
                self.fail(request_id, _describe(exc))
            return None

    def _postprocess(self, batch: list[Scheduled], hidden: torch.Tensor) -> None:
        to_sample: list[tuple[int, Sequence]] = []  # (row of hidden, sequence)
        row = 0
        for s in batch:
            first, row = row, row + s.num_tokens
            if s.seq.is_finished:
                continue  # its request failed earlier in this step
            try:
                to_sample += self._advance(s, hidden, first)
            except Exception as exc:
                log.exception("postprocessing %s failed", s.seq.request_id)
                self.fail(s.seq.request_id, _describe(exc))
        if to_sample:
            self._sample(to_sample, hidden)

    def _advance(self, s: Scheduled, hidden: torch.Tensor, first: int) -> list[tuple[int, Sequence]]:
        """Account one scheduled chunk, whose rows of the step's `hidden` begin at `first`; returns the (row, sequence)
        pairs that sample a token now."""
        seq, start = s.seq, s.seq.num_computed_tokens
        real = s.num_tokens - len(s.draft)  # a draft's rows are checked when the row before it is sampled
        last_row = first + real - 1
        if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens:
            self._add_prompt_logprobs(seq, hidden[first : last_row + 1], start)
        seq.num_computed_tokens += real
        if seq.num_computed_tokens < seq.num_tokens:
            return []  # mid-prefill: more chunks to go
        seq.registered_blocks = self.blocks.register_full_blocks(
            seq.token_ids, seq.block_table, seq.num_computed_tokens, seq.prefix, seq.registered_blocks
        )
        if seq.params.max_tokens == 0:
            self._finish_without_output(seq)
            return []
        if seq.params.n > 1 and not seq.forked:
            return [(last_row, seq), *((last_row, child) for child in self._fork(seq))]
        return [(last_row, seq)]

    def _sample(self, to_sample: list[tuple[int, Sequence]], hidden: torch.Tensor) -> None:
        """A token for each (row, sequence); then each draft checked, token by token (_check_drafts)."""
        to_sample = [(r, seq) for r, seq in to_sample if not seq.is_finished]
        if not to_sample:
            return
        drafted = [(r, seq, self._drafts[seq.seq_id]) for r, seq in to_sample if seq.seq_id in self._drafts]
        rows = [r for r, _ in to_sample] + [r + 1 + j for r, _, draft in drafted for j in range(len(draft))]
        keep = self._greedy_keep(to_sample[0][1]) if len(rows) == 1 else None
        head = self.runner.head if keep is not None and to_sample[0][0] == hidden.shape[0] - 1 else None
        if head is not None:  # the row's head ran in the forward's call, with this keep (_lone_greedy_keep)
            logits, summary = head
        else:
            logits, summary = gather_logits(self.runner, hidden, rows, keep)  # (N, V)
        if not drafted:
            self._sample_rows([seq for _, seq in to_sample], logits, summary)
            return
        n = len(to_sample)
        self._sample_rows([seq for _, seq in to_sample], logits[:n], _picked(summary, range(n)))
        drafts = [(seq, draft) for _, seq, draft in drafted]
        self._check_drafts(drafts, logits[n:], _picked(summary, range(n, len(rows))))

    def _check_drafts(
        self, drafted: list[tuple[Sequence, list[int]]], logits: torch.Tensor, summary: HeadSummary | None
    ) -> None:
        """Each sequence's draft against what it sampled: while the token just sampled is the draft's next one, the
        draft's row for it was computed with the right token, so its KV stands and the next token is sampled from
        its logits (`logits`: every draft's rows, draft after draft). The first token that differs is the right one
        where the draft went wrong; the draft's later rows are dropped (their KV is overwritten next step)."""
        starts, at = [], 0
        for _, draft in drafted:
            starts.append(at)
            at += len(draft)
        kept = [0] * len(drafted)
        for j in range(max(len(draft) for _, draft in drafted)):
            now = [
                i
                for i, (seq, draft) in enumerate(drafted)
                if kept[i] == j and j < len(draft) and not seq.is_finished and seq.token_ids[-1] == draft[j]
            ]
            if not now:
                break
            for i in now:
                drafted[i][0].num_computed_tokens += 1
                kept[i] += 1
            picked = [starts[i] + j for i in now]
            self._sample_rows([drafted[i][0] for i in now], logits[picked], _picked(summary, picked))
        st = self.stats
        for (seq, draft), accepted in zip(drafted, kept):
            st.spec_drafts += 1
            st.spec_draft_tokens += len(draft)
            st.spec_accepted_tokens += accepted
            if len(st.spec_accepted_per_position) < len(draft):
                st.spec_accepted_per_position.extend([0] * (len(draft) - len(st.spec_accepted_per_position)))
            for position in range(accepted):
                st.spec_accepted_per_position[position] += 1
            if seq.drafts is not None:
                seq.drafts.settle(len(draft), accepted)
            self._recent.settle(len(draft), accepted)
            if seq.is_finished and seq.finish_reason is not FinishReason.ABORT:  # it ended in this step (_finish)
                self._spec_responses.append(spec_response(seq))

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor, summary: HeadSummary | None) -> None:
        """One token for each sequence from its row of `logits` (and of the head's summary, where it has one)."""
        to_sample = list(enumerate(seqs))
        for i in non_finite_rows(logits, summary):  # fails its request alone; the rest of the batch samples as usual
            self.fail(to_sample[i][1].request_id, "the model produced non-finite logits for this request")
        argmax: list[int | None] = list(summary.argmax) if summary is not None else [None] * len(to_sample)
        alive = [i for i, (_, seq) in enumerate(to_sample) if not seq.is_finished]
        if len(alive) < len(to_sample):
            to_sample, logits, argmax = [to_sample[i] for i in alive], logits[alive], [argmax[i] for i in alive]
        inputs = [
            SampleInput(
                seq.params,
                seq.generator,
                seq.output_counts,
                seq.banned_ids(self.eos_ids),
                seq.seen_ids,
                mask,
                best,
            )
            for (_, seq), mask, best in zip(to_sample, guided_masks([seq for _, seq in to_sample]), argmax)
        ]
        for (_, seq), result in zip(to_sample, sample_rows(logits, inputs)):
            if seq.is_finished:
                continue  # another choice of its request failed
            try:
                if isinstance(result, Exception):
                    raise result
                self._append(seq, result)
            except GuideError as exc:
                self.fail(seq.request_id, str(exc), grammar_failed=True)
            except Exception as exc:
                log.exception("sampling or detokenising %s failed", seq.request_id)
                self.fail(seq.request_id, _describe(exc))

    def _draft(self, batch: list[Scheduled]) -> dict[int, list[int]]:
        """Drafts for a step of decode rows (speculation.py), as long as the step's cost says they pay (plan); each
        row's scheduled tokens grow by its draft, within the step's token budget and free KV blocks. A draft cannot
        change a sequence's tokens: they are sampled one by one through the same code, a sampled sequence's from its
        own generator, one draw per token in order as without a draft, so bias, bans, penalties, logprobs, stops and
        seeds behave as without."""
        spec = self.speculative
        if len(batch) > spec.max_rows:
            return {}  # where the fit said drafts paid, served 16-client steps ran 5-10% slower (decision 0038)
        if len(batch) > 1 and not all(s.seq.params.greedy for s in batch):
            return {}  # sampling a row costs more than its pass: several drafting sampled rows lost (decision 0037)
        states = [s.seq.drafts or DraftState.starting(self._recent.rate) for s in batch]
        fixed_rows = self.step_cost.fixed_rows(len(batch))
        explore = self.stats.steps % EXPLORE_EVERY == 0
        # the least chance a first draft token needs (plan); the bar only rises as tokens are added, so a row below it
        # gets no draft and no lookup, which costs a scan of its earlier tokens
        bar = 0.0 if explore else (1 + MARGIN) * len(batch) / (fixed_rows + len(batch))
        if max(state.rate for state in states) <= bar:
            return {}
        budget = min(self.scheduler.max_num_batched_tokens - len(batch), spec.step_tokens)
        # a kept token of a row under a grammar is sampled under its mask, one more pass over the vocabulary: a step's
        # drafts under grammars stay within the masks the scheduler allows a step, those of the rows themselves first
        masks_left = self.scheduler.max_guided_rows - sum(s.seq.guided is not None for s in batch)
        proposals: list[list[int]] = []
        stored: set[int] = set()  # the sequences whose proposal is the store's
        for s, state in zip(batch, states):
            seq = s.seq
            seq.drafts = state
            state.step()
            if state.pause:
                state.pause -= 1
                proposals.append([])
                continue
            if state.rate <= bar:
                proposals.append([])
                continue
            room = min(
                spec.num_tokens,
                budget,
                seq.params.max_tokens - seq.num_output_tokens - 1,  # the tokens a step may emit: the draft's + 1
                self.max_model_len - seq.num_tokens - 1,
            )
            if seq.guided is not None:
                room = min(room, masks_left)
            draft = seq.guided.forced(room) if seq.guided is not None else []
            if not draft:
                draft = propose(seq.token_ids, state, room, spec.min_ngram, spec.max_ngram)
            if not draft and self.store is not None:
                draft = self.store.propose(seq.params.tenant, seq.token_ids, room)
                stored.add(seq.seq_id)
            if seq.guided is not None:
                draft = draft[: seq.guided.valid_prefix(draft)]
                masks_left -= len(draft)
            proposals.append(draft)
        rates, lengths = [state.rate for state in states], [len(p) for p in proposals]
        credits = [state.credit for state in states]
        taken = plan(rates, lengths, fixed_rows, budget, credits, self.step_cost.seconds_at)
        if explore and not any(taken):  # one token, so the step cost of one more row is measured again
            taken = plan(rates, lengths, MAX_FIXED_ROWS, 1, max_slowdown=math.inf)
        drafts: dict[int, list[int]] = {}
        for s, proposal, n in zip(batch, proposals, taken):
            draft, seq = proposal[:n], s.seq
            if not draft or not self.scheduler.reserve_free(seq, seq.num_tokens + len(draft)):
                continue
            s.draft, s.num_tokens = draft, 1 + len(draft)
            drafts[seq.seq_id] = draft
            self.stats.spec_store_drafts += seq.seq_id in stored
        return drafts

    def _lone_greedy_keep(self, batch: list[Scheduled]) -> list[int] | None:
        """Where the step is one sequence's decode row, sampled alone and greedily from its argmax and a few ids:
        those ids (the runner may then run the head in the same call as the layers); else None."""
        if len(batch) != 1 or batch[0].num_tokens != 1:
            return None
        seq = batch[0].seq
        if seq.num_computed_tokens + 1 != seq.num_tokens or seq.num_computed_tokens < seq.num_prompt_tokens:
            return None  # not a decode row that samples after this step
        return self._greedy_keep(seq)

    def _greedy_keep(self, seq: Sequence) -> list[int] | None:
        """A lone row's ids whose logits its sampling reads besides its argmax, where it reads no others (greedy_keep):
        the head may then skip the columns that cannot win."""
        if seq.guided is not None:
            return None
        return greedy_keep(SampleInput(seq.params, None, seq.output_counts, seq.banned_ids(self.eos_ids), seq.seen_ids))

    def _append(self, seq: Sequence, result: Sampled) -> None:
        entry = None
        if seq.params.logprobs is not None:
            top = [(t, self.token_text(t), lp) for t, lp in result.top]
            entry = TokenLogprob(result.token_id, self.token_text(result.token_id), result.logprob, top)
        seq.append_token(result.token_id, result.logprob, entry)
        token, p = result.token_id, seq.params
        if seq.guided is not None:
            seq.guided.advance(token)
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            seq.stop_reason = token if token in p.stop_token_ids else None  # vLLM's: EOS is no stop_reason
            self._finish(seq, FinishReason.STOP)
            return
        seq.add_text(seq.detok.add(token))
        if seq.stop.matched is not None or seq.filtered or (seq.guided is not None and seq.guided.done):
            self._finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.end_text()
        if seq.stop.matched is not None:
            reason, seq.stop_reason = FinishReason.STOP, seq.stop.matched
        if seq.filtered:  # the filter's cut came first in the text, or the stop string's text held a match
            reason, seq.stop_reason = FinishReason.CONTENT_FILTER, None
        self.scheduler.finish(seq)
        seq.finish(reason)
        if self.store is not None and seq.num_output_tokens:
            self.store.add(seq.params.tenant, seq.token_ids)
        if self.speculative.enabled and seq.seq_id not in self._drafts:  # else once its draft is settled
            self._spec_responses.append(spec_response(seq))

    def _finish_without_output(self, parent: Sequence) -> None:
        """max_tokens == 0: every choice ends at once with no tokens (the prompt may still have been scored)."""
        state = self.requests[parent.request_id]
        self._finish(parent, FinishReason.LENGTH)
        for j in range(1, parent.params.n):
            state.add_sequence(j, self.tokenizer).finish(FinishReason.LENGTH)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Children share the parent's prefilled prompt blocks; the partial last block is copied."""
        state = self.requests[parent.request_id]
        parent.forked = True
        children = []
        for j in range(1, parent.params.n):
            child = state.add_sequence(j, self.tokenizer)
            child.forked = True
            child.num_cached_tokens = parent.num_cached_tokens
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
        new = prompt_logprob_entries(
            self.runner,
            hidden,
            seq.token_ids,
            start,
            seq.num_prompt_tokens,
            seq.params.prompt_logprobs or 0,
            self.token_text,
        )
        if any(e.logprob is not None and math.isnan(e.logprob) for e in new):
            raise FloatingPointError("the model produced non-finite logits for this prompt")
        entries.extend(new)
        if len(entries) == seq.num_prompt_tokens:
            seq.prompt_logprobs = entries

    # ---- reporting ----
    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, state in list(self.requests.items()):
            out = state.take_output()
            if out is None:
                continue
            outputs.append(out)
            if out.finished:
                del self.requests[request_id]
        return outputs

    # ---- helpers ----
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

    def _report(self, batch: list[Scheduled], duration_s: float) -> None:
        if not self.step_observers:
            return
        report = StepReport(duration_s, len(batch), sum(s.num_tokens for s in batch))
        for observe in self.step_observers:
            try:
                observe(report)
            except Exception:  # an observer's bug must not fail the requests of the step it watched
                log.exception("a step observer failed")

    def close(self) -> None:
        """At shutdown: the blocks queued for the disk tier written (bounded), its writer stopped."""
        if self.blocks.tiers is not None:
            self.blocks.tiers.close()

    def prefill_backlog(self) -> int:
        """Prompt tokens taken but not yet computed: those of each waiting sequence past what the prefix cache holds
        of it now, and the rest of the prompts part-way through their prefill. What a router weighs to send a prompt
        where its first token comes soonest."""
        waiting = sum(
            seq.num_tokens - (0 if seq.wants_prompt_logprobs else self.blocks.cached_tokens(seq.token_ids, seq.prefix))
            for seq in self.scheduler.waiting
        )
        started = sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in self.scheduler.running)
        return waiting + started

    def snapshot_stats(self) -> EngineStats:
        st = self.stats
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.num_used_blocks = self.blocks.num_used
        st.num_free_blocks = self.blocks.num_free
        st.num_preemptions = self.scheduler.num_preemptions
        if self.store is not None:
            st.spec_store_tokens, st.spec_store_bytes = self.store.tokens, self.store.nbytes()
        if self.blocks.tiers is not None:
            for name, value in vars(self.blocks.tiers.stats()).items():
                setattr(st, f"kv_{name}", value)
        return EngineStats(
            **{
                **vars(st),
                "spec_accepted_per_position": list(st.spec_accepted_per_position),
                "spec_responses": list(self._spec_responses),
            }
        )


def spec_response(seq: Sequence) -> dict[str, Any]:
    """What speculation did for one finished choice: its drafts, their tokens and those kept (none where it never
    drafted: a prompt with nothing to look up, or a step too full to draft in)."""
    state = seq.drafts or DraftState()
    drafted, kept = state.total_drafted, state.total_kept
    return {
        "request_id": seq.request_id,
        "index": seq.index,
        "completion_tokens": seq.num_output_tokens,
        "drafts": state.total_drafts,
        "draft_tokens": drafted,
        "accepted_tokens": kept,
        "acceptance": kept / drafted if drafted else None,
    }


def _decode_row(s: Scheduled) -> bool:
    """One new token of a sequence past its prompt: what a draft may follow."""
    seq = s.seq
    return s.num_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_tokens >= seq.num_prompt_tokens + 1


def _picked(summary: HeadSummary | None, rows: Iterable[int]) -> HeadSummary | None:
    return None if summary is None else summary.picked(rows)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
