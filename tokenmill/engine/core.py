"""EngineCore: the synchronous engine. One step reads as schedule → run model → postprocess.

Only the engine's worker thread calls into this class; the async front (engine.py) hands it requests and aborts.
A fault that belongs to one request (non-finite logits in its rows, an exception while sampling, detokenising or
stopping its text) fails that request alone, with an error output; a failed forward pass fails that batch's requests.
"""

from __future__ import annotations

import logging
import math
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
        self._failed: list[RequestOutput] = []  # error outputs of requests failed during this step

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

    def fail(self, request_id: str, message: str) -> None:
        """End one request with an error (its blocks are freed); the others carry on."""
        state = self.requests.get(request_id)
        if state is None:
            return
        log.error("request %s failed: %s", request_id, message)
        self.abort(request_id)
        self._failed.append(RequestOutput(request_id, [], state.prompt_ids, finished=True, error=message))

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch:
            hidden = self._forward(batch)
            if hidden is not None:
                self._postprocess(batch, hidden)
            self._count(batch)
        failed, self._failed = self._failed, []
        return failed + self._collect_outputs()

    def _forward(self, batch: list[Scheduled]) -> torch.Tensor | None:
        try:
            return self.runner.forward(batch)
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
                to_sample += self._advance(s, hidden[first:row], row - 1)
            except Exception as exc:
                log.exception("postprocessing %s failed", s.seq.request_id)
                self.fail(s.seq.request_id, _describe(exc))
        if to_sample:
            self._sample(to_sample, hidden)

    def _advance(self, s: Scheduled, hidden: torch.Tensor, last_row: int) -> list[tuple[int, Sequence]]:
        """Account one scheduled chunk; returns the (row, sequence) pairs that sample a token now."""
        seq, start = s.seq, s.seq.num_computed_tokens
        if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens:
            self._add_prompt_logprobs(seq, hidden, start)
        seq.num_computed_tokens += s.num_tokens
        if seq.num_computed_tokens < seq.num_tokens:
            return []  # mid-prefill: more chunks to go
        self.blocks.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed_tokens)
        if seq.params.max_tokens == 0:
            self._finish_without_output(seq)
            return []
        if seq.params.n > 1 and not seq.forked:
            return [(last_row, seq), *((last_row, child) for child in self._fork(seq))]
        return [(last_row, seq)]

    def _sample(self, to_sample: list[tuple[int, Sequence]], hidden: torch.Tensor) -> None:
        to_sample = [(r, seq) for r, seq in to_sample if not seq.is_finished]
        if not to_sample:
            return
        rows = sorted({r for r, _ in to_sample})
        logits = self.runner.logits(hidden[rows])  # (R, V)
        if [r for r, _ in to_sample] != rows:  # forked choices share their parent's row: (N, V), a copy
            where = {r: i for i, r in enumerate(rows)}
            logits = logits[[where[r] for r, _ in to_sample]]
        to_sample, logits = self._drop_non_finite(to_sample, logits)
        inputs = [SampleInput(seq.params, seq.generator, seq.output_counts) for _, seq in to_sample]
        for (_, seq), result in zip(to_sample, self._sample_rows(logits, inputs)):
            if seq.is_finished:
                continue  # another choice of its request failed
            try:
                if isinstance(result, Exception):
                    raise result
                self._append(seq, result)
            except Exception as exc:
                log.exception("sampling or detokenising %s failed", seq.request_id)
                self.fail(seq.request_id, _describe(exc))

    def _drop_non_finite(
        self, to_sample: list[tuple[int, Sequence]], logits: torch.Tensor
    ) -> tuple[list[tuple[int, Sequence]], torch.Tensor]:
        """A NaN/inf logits row fails its request alone; the rest of the batch samples as usual."""
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()  # (N,): one pass; a NaN or inf anywhere spoils the sum
        for (_, seq), ok in zip(to_sample, finite):
            if not ok:
                self.fail(seq.request_id, "the model produced non-finite logits for this request")
        keep = [i for i, (_, seq) in enumerate(to_sample) if not seq.is_finished]
        if len(keep) == len(to_sample):
            return to_sample, logits
        return [to_sample[i] for i in keep], logits[keep]

    def _sample_rows(self, logits: torch.Tensor, inputs: list[SampleInput]) -> list[Sampled | Exception]:
        """The batch at once; if that fails, row by row, so only the row at fault fails."""
        try:
            return list(sample(logits, inputs))
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
        results: list[Sampled | Exception] = []
        for i, row in enumerate(inputs):
            try:
                results.extend(sample(logits[i : i + 1], [row]))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which fails that row's request
                results.append(exc)
        return results

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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
