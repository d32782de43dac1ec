"""One choice's progress: engine deltas folded into its text, logprobs, token ids and finish reason, and its wire
pieces (a stream chunk's choice, or the whole choice of a response)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.api import protocol
from tokenmill.api.errors import server_error
from tokenmill.api.logprobs import (
    LogprobsBuilder,
    TokenView,
    empty_logprobs,
    extend_logprobs,
    finite,
    vllm_prompt_logprobs,
)
from tokenmill.api.prompts import Prompt
from tokenmill.engine.outputs import FinishReason, SequenceDelta, TokenLogprob

T = TypeVar("T")
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CONTENT_FILTER: "content_filter"}


@dataclass
class Choice:
    index: int
    prompt: Prompt
    echo_pending: bool
    builder: LogprobsBuilder | None
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top-k per prompt token
    view: TokenView | None = None  # how prompt_logprobs' alternatives are read (the content filter)
    text: list[str] = field(default_factory=list)
    logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_tokens: int = 0
    sent_prompt_extras: bool = False  # streamed: the prompt's token ids and logprobs go with the choice's first chunk

    def update(self, delta: SequenceDelta) -> dict[str, Any] | None:
        """Fold in one delta; return its stream piece (None when there is nothing to show)."""
        if delta.finish_reason is FinishReason.ABORT:
            raise server_error("The request was aborted by the engine.")
        self.num_tokens = max(self.num_tokens + len(delta.token_ids), delta.num_tokens)
        self.cumulative_logprob = delta.cumulative_logprob
        self.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = _FINISH[delta.finish_reason]
            self.stop_reason = delta.stop_reason
        return self._piece(delta.text, delta.logprobs or [], delta.token_ids)

    def finish_without_delta(self, max_tokens: int) -> dict[str, Any]:
        """The engine finished the request with no final delta for this sequence: infer why."""
        self.finish_reason = "length" if self.num_tokens >= max_tokens else "stop"
        return self._piece("", [], []) or self.piece("", None, [])

    def _piece(self, text: str, entries: list[TokenLogprob], token_ids: list[int]) -> dict[str, Any] | None:
        fragment = self._logprobs_fragment(entries, text)
        if self.echo_pending:
            text, self.echo_pending = self.prompt.text + text, False
        self.text.append(text)
        if not text and not token_ids and self.finish_reason is None and not (fragment and fragment["tokens"]):
            return None
        return self.piece(text, fragment, token_ids)

    def piece(self, text: str, logprobs: dict[str, Any] | None, token_ids: list[int]) -> dict[str, Any]:
        """This choice's wire object for `text` (a stream piece, or the whole text with the whole token ids)."""
        extras: dict[str, Any] = {}
        first = not self.sent_prompt_extras
        self.sent_prompt_extras = True
        if self.return_token_ids:
            extras = {"prompt_token_ids": self.prompt.token_ids} if first else {}
            extras["token_ids"] = token_ids
        if self.prompt_logprobs is not None and first:
            extras["prompt_logprobs"] = self._once("prompt_logprobs", self._vllm_prompt_logprobs)
        return protocol.choice(self.index, text, logprobs, self.finish_reason, self.stop_reason, extras)

    def _logprobs_fragment(self, entries: list[TokenLogprob], text: str) -> dict[str, list[Any]] | None:
        """This piece's logprobs (`text`: its generated text)."""
        if self.builder is None:
            return None
        fragment = empty_logprobs()
        if self.echo_pending:
            builder = self.builder
            if "echo" in self.prompt.shared:
                builder.after_prompt(self.prompt.text)
            hidden = self.prompt.token_ids[: self.prompt.hidden]
            echoed = self._once("echo", lambda: builder.prompt(self.prompt.echoed_logprobs, self.prompt.text, hidden))
            extend_logprobs(fragment, echoed)
        extend_logprobs(fragment, self.builder.generated(entries, text, final=self.finish_reason is not None))
        if self.logprobs is None:
            self.logprobs = empty_logprobs()
        extend_logprobs(self.logprobs, fragment)
        return fragment

    def _once(self, key: str, make: Callable[[], T]) -> T:
        """What every choice of this prompt writes alike, made by the first one that needs it: a prompt's logprobs
        are worked out once, not once per choice (n × a long prompt's alternatives)."""
        if key not in self.prompt.shared:
            self.prompt.shared[key] = make()
        made: T = self.prompt.shared[key]
        return made

    def _vllm_prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None]:
        assert self.prompt_logprobs is not None
        hidden = self.prompt.token_ids[: self.prompt.hidden]
        return vllm_prompt_logprobs(self.prompt.echoed_logprobs, self.prompt_logprobs, self.view, hidden)

    @property
    def mean_logprob(self) -> float:
        return finite(self.cumulative_logprob) / self.num_tokens if self.num_tokens else 0.0
