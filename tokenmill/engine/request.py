"""RequestState: one request's choices (its n sequences) and what of their progress has been reported.

The core steps sequences; a request is what the caller sees, so it is here that each step's pending tokens and text
are taken off its sequences and handed back as one RequestOutput (or none, when nothing changed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tokenmill.engine.adapters import LoadedAdapter
from tokenmill.engine.detok import IncrementalDetokenizer
from tokenmill.engine.guided import GuidedState
from tokenmill.engine.outputs import RequestOutput, SequenceDelta
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.sequence import Sequence
from tokenmill.tokenizer import Tokenizer

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)  # choice j at index j
    reported: set[int] = field(default_factory=set)  # seq indices whose finish has been reported
    sent_first: bool = False
    vocab_size: int = 0  # the model's logits width (a grammar's token masks are this wide)
    adapter: LoadedAdapter | None = None  # the LoRA adapter its sequences run with (SamplingParams.adapter)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def add_sequence(self, index: int, tokenizer: Tokenizer) -> Sequence:
        """Choice `index`, with its own generator: seeded requests mix the seed with the index, so choices differ."""
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        generator = torch.Generator().manual_seed((seed * _SEED_MIX + index) % (1 << 63))
        detok = IncrementalDetokenizer(tokenizer, self.prompt_ids, self.params.skip_special_tokens)
        guide = self.params.guide
        guided = GuidedState(guide, tokenizer, self.vocab_size) if guide is not None else None
        seq = Sequence(self.request_id, index, self.prompt_ids, self.params, detok, generator, guided, self.adapter)
        self.seqs.append(seq)
        return seq

    def take_output(self) -> RequestOutput | None:
        """What the choices produced since the last call (None if nothing); prompt logprobs go with the first."""
        deltas = [d for seq in self.seqs if (d := self._take_delta(seq)) is not None]
        if not deltas:
            return None
        parent = self.seqs[0]
        out = RequestOutput(
            self.request_id, deltas, self.prompt_ids, parent.num_cached_tokens, finished=self.is_finished
        )
        if not self.sent_first:
            out.prompt_logprobs = parent.prompt_logprobs
            self.sent_first = True
        return out

    def error_output(self, message: str, grammar_failed: bool = False) -> RequestOutput:
        return RequestOutput(
            self.request_id, [], self.prompt_ids, finished=True, error=message, grammar_failed=grammar_failed
        )

    def _take_delta(self, seq: Sequence) -> SequenceDelta | None:
        if seq.index in self.reported or not (seq.pending_ids or seq.pending_text or seq.is_finished):
            return None
        delta = SequenceDelta(
            index=seq.index,
            text=seq.pending_text,
            token_ids=seq.pending_ids,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob,
            num_tokens=seq.num_output_tokens,
        )
        seq.pending_text, seq.pending_ids, seq.pending_logprobs = "", [], []
        if seq.is_finished:
            self.reported.add(seq.index)
        return delta
