"""Sequence: one choice's whole state — tokens, KV blocks, sampling generator, text and finish reason."""

from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from tokenmill.engine.adapters import LoadedAdapter
from tokenmill.engine.detok import IncrementalDetokenizer
from tokenmill.engine.guided import GuidedState
from tokenmill.engine.kv_cache import PrefixHashes
from tokenmill.engine.outputs import FinishReason, TokenLogprob
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.speculation import DraftState
from tokenmill.engine.stop import StopChecker

_ids = itertools.count()


class Status(Enum):
    WAITING = auto()  # not yet holding KV blocks (new, or preempted and to be recomputed)
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        generator: torch.Generator | None,
        guided: GuidedState | None = None,
        adapter: LoadedAdapter | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # choice index within the request
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.adapter = adapter  # the LoRA adapter its rows run with; None: the base model
        self.prefix = PrefixHashes(params.cache_salt, adapter.digest if adapter else None)  # its blocks' cache keys
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.registered_blocks = 0  # leading blocks of block_table offered to the prefix cache (register_full_blocks)
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at first admission
        self.generator = generator
        self.detok = detok
        self.stop = StopChecker(params.stop, params.include_stop_str_in_output)
        cf = params.content_filter
        self.filter = cf.checker(params.content_filter_context) if cf is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.guided = guided  # its place in a structured-output grammar
        self.cumulative_logprob = 0.0
        self.output_counts: dict[int, int] = {}  # generated token id → times generated (penalties)
        # every distinct token so far, prompt included: only kept when repetition_penalty needs it
        self.seen_ids: set[int] = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self.prompt_logprobs: list[TokenLogprob] | None = None  # set once every prompt position is scored
        self.partial_prompt_logprobs: list[TokenLogprob] = []
        # Output produced since the last time the engine reported on this sequence.
        self.pending_text = ""
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        # With a content filter, a token is reported only once all of its text has been shown, so token ids and
        # logprobs never reveal text the filter held back: (token id, logprob entry, output length after its text).
        self.held_tokens: list[tuple[int, TokenLogprob | None, int]] = []
        self.text_len = 0  # characters of output text produced (detokenised), shown or not
        self.shown_len = 0  # characters of output text released to pending_text
        self.forked = False  # children created from this prefilled prompt (n > 1)
        self.drafts: DraftState | None = None  # its lookup index and drafts' record, once speculation drafts for it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def append_token(self, token_id: int, logprob: float | None, entry: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:  # None: the request neither reports nor ranks by logprobs
            self.cumulative_logprob += logprob
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self.seen_ids.add(token_id)
        if self.filter is not None:
            self.held_tokens.append((token_id, entry, -1))  # its text comes with the next add_text
        else:
            self._report_token(token_id, entry)

    def add_text(self, text: str) -> None:
        """The newest token's text through the stop strings and the content filter into what the client sees."""
        self.text_len += len(text)
        if self.held_tokens and self.held_tokens[-1][2] < 0:
            token_id, entry, _ = self.held_tokens[-1]
            self.held_tokens[-1] = (token_id, entry, self.text_len)
        self._show(self.stop.feed(text, check=not self.below_min_tokens))

    def end_text(self) -> None:
        """The sequence ends: release what the detokeniser, the stop strings and the filter still hold (unless a
        stop string or a filter match cut it), and the tokens whose text was shown (all, unless the filter cut)."""
        if self.stop.matched is None:
            self.add_text(self.detok.flush())
            self._show(self.stop.flush())
        if self.filter is not None:
            self._release(self.filter.flush())
            cut = self.filter.matched
            for token_id, entry, end in self.held_tokens:
                if not cut or end <= self.shown_len:
                    self._report_token(token_id, entry)
            self.held_tokens = []

    @property
    def filtered(self) -> bool:
        """The content filter found a match in this output: it ends before it."""
        return self.filter is not None and self.filter.matched

    def _show(self, text: str) -> None:
        """Text past the stop strings: through the content filter, if any, to the client."""
        self._release(self.filter.feed(text) if self.filter is not None else text)

    def _release(self, text: str) -> None:
        """Text the client may see, and the held tokens whose text it completes (none without a filter)."""
        self.pending_text += text
        self.shown_len += len(text)
        while self.held_tokens and 0 <= self.held_tokens[0][2] <= self.shown_len:
            token_id, entry, _ = self.held_tokens.pop(0)
            self._report_token(token_id, entry)

    def _report_token(self, token_id: int, entry: TokenLogprob | None) -> None:
        self.pending_ids.append(token_id)
        if entry is not None:
            self.pending_logprobs.append(entry)

    @property
    def below_min_tokens(self) -> bool:
        return self.num_output_tokens < self.params.min_tokens

    def banned_ids(self, eos_ids: set[int]) -> list[int]:
        """Tokens this sequence must not sample next: its end tokens before min_tokens, and the last token of any
        bad word whose other tokens end the output (a one-token bad word always)."""
        p = self.params
        banned = [*(() if p.ignore_eos else eos_ids), *p.stop_token_ids] if self.below_min_tokens else []
        if p.bad_words_ids:
            output = self.output_ids
            for word in p.bad_words_ids:
                head = list(word[:-1])
                if not head or output[len(output) - len(head) :] == head:
                    banned.append(word[-1])
        return banned

    def finish(self, reason: FinishReason) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
