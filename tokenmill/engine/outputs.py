"""What the engine hands back: plain dataclasses of ids, text and logprobs (no HTTP, no pydantic)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens (or the context) reached
    CONTENT_FILTER = "content_filter"  # the server's content filter matched the output; it ends before the match
    ABORT = "abort"  # cancelled: client gone, timeout, engine fault


@dataclass
class TokenLogprob:
    """One token with the model's own log-probability and the top-k alternatives (sorted, best first)."""

    token_id: int
    text: str  # the text this token added to the output ("" while a UTF-8 character is still incomplete)
    logprob: float | None  # None for the first prompt token, which has no context to be predicted from
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, token text, logprob)
    rank: int | None = None  # prompt tokens: 1 + how many tokens the model found likelier


@dataclass
class SequenceDelta:
    """New progress of one choice since its previous delta."""

    index: int  # which of the request's n sequences
    text: str  # new visible text: never half a UTF-8 character, never (part of) a stop string
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # aligned with token_ids when logprobs were asked for
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0  # sum of chosen-token logprobs so far (ranks best_of)
    num_tokens: int = 0  # tokens generated so far in total
    stop_reason: int | str | None = None  # with finish_reason STOP: the stop token id or string; None for EOS


@dataclass
class RequestOutput:
    """One engine step's worth of news for one request."""

    request_id: str
    deltas: list[SequenceDelta]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # set once, on the first output, when asked for
    finished: bool = False  # every sequence of the request is done
    error: str | None = None  # the request failed inside the engine; its sequences are aborted
    # with error: the engine itself went away (a replica's process died), not the request's fault; a client that has
    # been sent nothing of it yet may be served afresh
    lost: bool = False
    # with error: the request's own grammar (structured outputs) outgrew the matcher's limits: the client's fault
    grammar_failed: bool = False


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two successive outputs of one request as one (a chunk of --stream-interval): each sequence's text, tokens and
    logprobs joined; its finish and totals the later one's; the prompt's cache and logprobs the earlier one's."""
    deltas = {delta.index: delta for delta in first.deltas}
    for later in then.deltas:
        earlier = deltas.get(later.index)
        if earlier is None:
            deltas[later.index] = later
            continue
        logprobs = None
        if earlier.logprobs is not None or later.logprobs is not None:
            logprobs = (earlier.logprobs or []) + (later.logprobs or [])
        deltas[later.index] = SequenceDelta(
            later.index,
            earlier.text + later.text,
            earlier.token_ids + later.token_ids,
            logprobs,
            later.finish_reason,
            later.cumulative_logprob,
            later.num_tokens,
            later.stop_reason,
        )
    return RequestOutput(
        then.request_id,
        sorted(deltas.values(), key=lambda delta: delta.index),
        first.prompt_token_ids,
        first.num_cached_tokens,
        first.prompt_logprobs,
        then.finished,
        then.error,
        then.lost,
        then.grammar_failed,
    )


def chunk_complete(output: RequestOutput, tokens: int) -> bool:
    """Whether a chunk of --stream-interval `tokens` goes out as it is: a sequence gained that many tokens in it, or
    it ends the request (finished, or an error)."""
    if output.finished or output.error is not None:
        return True
    return max((len(delta.token_ids) for delta in output.deltas), default=0) >= tokens


@dataclass(frozen=True)
class StepReport:
    """One engine step that ran a batch, told to the step observers (metrics) on the engine thread."""

    duration_s: float  # schedule + forward + sampling + postprocessing
    num_seqs: int  # sequences in the batch
    num_tokens: int  # tokens computed: prefill chunks + one per decode


@dataclass(frozen=True)
class EngineDescription:
    """What an engine serves and on what, for the start-up banner: plain values, so the HTTP edge needs no torch."""

    dtype: str
    quantization: str  # the weights' quantisation as run (a Hugging Face directory's "gguf" runs as int8)
    kv_cache_tokens: int  # KV-cache blocks x block size: how many tokens all running sequences can hold together
    kernels: tuple[str, ...]  # the C kernels this model's path calls; empty: torch only
    # the prefix cache's tiers past the live cache: RAM's budget in bytes (0: none), the disk folder and its budget
    kv_ram_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter an engine serves: the name a request's `model` picks it by, and what it was loaded from."""

    name: str
    path: str
    system_fingerprint: str  # the model's, with the adapter's weights in it


class AdapterLoadError(Exception):
    """An adapter that cannot be loaded (not found, not LoRA, built for another model, over a limit): the message
    says which and why, in one line."""
