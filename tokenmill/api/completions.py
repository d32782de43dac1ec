"""POST /v1/completions: prompts × n (× best_of) → engine requests → one response or an SSE stream.

Each prompt becomes one engine request whose SamplingParams.n sequences are its choices (index = prompt × n + j). All
prompts run concurrently; closing the output stream (client gone, task cancelled) closes every engine generator, which
aborts the requests. Stop strings, EOS, max_tokens and UTF-8-safe text are the engine's job: deltas are final text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tokenmill.api import protocol, sse
from tokenmill.api.admission import RETRY_AFTER_S
from tokenmill.api.errors import (
    REQUEST_TIMEOUT,
    APIError,
    context_length_exceeded,
    invalid_request,
    request_timeout,
    server_error,
    service_unavailable,
)
from tokenmill.api.limits import RequestLimits
from tokenmill.api.logprobs import LogprobsBuilder, empty_logprobs, extend_logprobs, finite, vllm_prompt_logprobs
from tokenmill.api.protocol import CompletionMeta, CompletionRequest
from tokenmill.api.record import CompletionRecord, PromptRecord, pseudonym
from tokenmill.engine import guided
from tokenmill.engine.content_filter import ContentFilter
from tokenmill.engine.guided import GuideError
from tokenmill.engine.outputs import FinishReason, RequestOutput, SequenceDelta, TokenLogprob
from tokenmill.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def supports_fim(self) -> bool: ...

    @property
    def fim_end_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_infill(self, prefix: str, suffix: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class Engine(Protocol):
    """What the HTTP edge needs of tokenmill.engine.engine.AsyncEngine."""

    max_model_len: int
    model_name: str
    system_fingerprint: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    def is_healthy(self) -> bool: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...


@dataclass
class Prompt:
    token_ids: list[int]  # what the model reads
    text: str  # what echo returns: the string as sent, or the decoded token ids
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # the prompt tokens' own logprobs, for echo
    hidden: int = 0  # leading tokens the model reads but the client did not send (an added BOS): echo leaves them out
    started_at: float | None = None  # time.monotonic() of its first engine output, first token, last token, end
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    def saw(self, output: RequestOutput, now: float) -> None:
        """Note when an output arrived: the first one, and those that brought tokens or the end."""
        if self.started_at is None:
            self.started_at = now
        if any(delta.token_ids for delta in output.deltas):
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if output.finished:
            self.finished_at = now

    @property
    def echoed_logprobs(self) -> list[TokenLogprob]:
        return (self.logprobs or [])[self.hidden :]


# --- preparing: everything that can be a 400 happens before the first engine call ---------------------------------
def prepare_prompts(request: CompletionRequest, engine: Engine, max_tokens: int) -> list[Prompt]:
    tokenizer = engine.tokenizer
    _check_in_vocabulary([int(key) for key in request.logit_bias or {}], tokenizer.vocab_size, "logit_bias")
    _check_in_vocabulary(request.stop_token_ids or [], tokenizer.vocab_size, "stop_token_ids")
    _check_in_vocabulary(request.allowed_token_ids or [], tokenizer.vocab_size, "allowed_token_ids")
    items = _prompt_items(request.prompt)
    if request.suffix:
        prompts = [_infill_prompt(item, request.suffix, tokenizer) for item in items]
    else:
        with_text = bool(request.echo) or request.logprobs is not None  # echo returns it; text_offset counts it
        prompts = [_prompt(item, tokenizer, with_text, request.truncate_prompt_tokens) for item in items]
    for prompt in prompts:
        if len(prompt.token_ids) + max_tokens > engine.max_model_len:
            raise context_length_exceeded(engine.max_model_len, len(prompt.token_ids), max_tokens)
    return prompts


def _prompt_items(prompt: protocol.PromptInput | None) -> Sequence[str | list[int]]:
    if prompt is None:  # OpenAI: no prompt means "from the start of a document"
        return [""]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return prompt


def _check_in_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"'{param}' token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def _prompt(item: str | list[int], tokenizer: Tokenizer, with_text: bool, keep_last: int | None = None) -> Prompt:
    """A text prompt gets BOS as the tokenizer adds it. A token-id prompt is read as sent, but for a model that
    starts every text with BOS, one is put before ids that do not start with it, unseen by the client (echo and its
    logprobs are the tokens sent): evaluation harnesses send ids without it (lm-evaluation-harness's remote tokenizer
    asks for no special tokens), and the model scores text it was never trained to see without it.

    `with_text`: a token-id (or truncated) prompt's text is decoded, for echo and text_offset. `keep_last`
    (truncate_prompt_tokens): only the last tokens the model would read are kept; echo then returns their text."""
    if isinstance(item, str):
        ids, text, hidden = tokenizer.encode(item) or _document_start(tokenizer), item, 0
    else:
        _check_in_vocabulary(item, tokenizer.vocab_size, "prompt")
        bos = tokenizer.bos_id
        added = [bos] if bos is not None and item[0] != bos and adds_bos(tokenizer) else []
        ids, text, hidden = added + list(item), tokenizer.decode(item) if with_text else "", len(added)
    if keep_last is not None and len(ids) > keep_last:
        cut = len(ids) - keep_last
        ids, hidden = ids[cut:], max(hidden - cut, 0)
        text = tokenizer.decode(ids) if with_text else ""
    return Prompt(ids, text, hidden=hidden)


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer starts every encoded text with BOS (its settings, else what it does)."""
    add_bos = getattr(tokenizer, "add_bos", None)
    if add_bos is None:
        add_bos = tokenizer.bos_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_id]
    return bool(add_bos)


def _infill_prompt(item: str | list[int], suffix: str, tokenizer: Tokenizer) -> Prompt:
    """The prompt is the text before the gap, `suffix` the text after it: the model's fill-in-the-middle layout
    (tokenizer/fim.py). echo returns the prompt as sent."""
    if not tokenizer.supports_fim:
        raise invalid_request("'suffix' is not supported: this model has no fill-in-the-middle tokens", "suffix")
    if not isinstance(item, str):
        raise invalid_request("'suffix' needs the prompt as text, not token ids", "suffix")
    return Prompt(tokenizer.encode_infill(item, suffix), item)


def _document_start(tokenizer: Tokenizer) -> list[int]:
    """An empty string prompt on a tokenizer that adds no BOS: start from BOS (or EOS, the document separator)."""
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if start is None:
        raise invalid_request("'prompt' is empty and this model has no BOS/EOS token to start from", "prompt")
    return [start]


# --- one choice's progress ------------------------------------------------------------------------------------------
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CONTENT_FILTER: "content_filter"}


@dataclass
class Choice:
    index: int
    prompt: Prompt
    echo_pending: bool
    builder: LogprobsBuilder | None
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top-k per prompt token
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
        fragment = self._logprobs_fragment(entries)
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
            extras["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt.echoed_logprobs, self.prompt_logprobs)
        return protocol.choice(self.index, text, logprobs, self.finish_reason, self.stop_reason, extras)

    def _logprobs_fragment(self, entries: list[TokenLogprob]) -> dict[str, list[Any]] | None:
        if self.builder is None:
            return None
        fragment = empty_logprobs()
        if self.echo_pending:
            extend_logprobs(fragment, self.builder.prompt(self.prompt.echoed_logprobs, self.prompt.text))
        extend_logprobs(fragment, self.builder.generated(entries))
        if self.logprobs is None:
            self.logprobs = empty_logprobs()
        extend_logprobs(self.logprobs, fragment)
        return fragment

    @property
    def mean_logprob(self) -> float:
        return finite(self.cumulative_logprob) / self.num_tokens if self.num_tokens else 0.0


# --- one request ----------------------------------------------------------------------------------------------------
class Completion:
    def __init__(
        self,
        request: CompletionRequest,
        engine: Engine,
        limits: RequestLimits | None = None,
        content_filter: ContentFilter | None = None,
        arrived_at: float | None = None,
    ) -> None:
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at  # when the request came in
        self.admitted_at: float | None = None  # set by whoever admits it (the app)
        self.error: APIError | None = None  # what it ended with, raised or streamed
        self.finished = False  # it ran to its end (every prompt finished, the response or last chunk is made)
        self.request = request
        self.engine = engine
        self.limits = limits or RequestLimits()
        self.params = request.to_sampling_params()
        if content_filter is not None:
            self.params = dataclasses.replace(self.params, content_filter=content_filter)
        if request.suffix and engine.tokenizer.supports_fim:  # a filled-in middle ends at the model's end tokens
            ends = self.params.stop_token_ids + engine.tokenizer.fim_end_ids
            self.params = dataclasses.replace(self.params, stop_token_ids=ends)
        if request.bad_words:
            self.params = dataclasses.replace(self.params, bad_words_ids=bad_words_ids(request.bad_words, engine))
        _check_something_is_allowed(self.params, engine.tokenizer)
        if self.params.guide is not None:
            param = "structured_outputs" if request.structured_outputs is not None else "response_format"
            try:
                guided.check(self.params.guide, engine.tokenizer)
            except GuideError as exc:
                raise invalid_request(f"'{param}' cannot be used: {exc}", param) from None
        self.limits.check_counts(len(_prompt_items(request.prompt)), self.params.n)
        self.prompts = prepare_prompts(request, engine, self.params.max_tokens)
        if content_filter is not None:
            check_content(request, self.prompts, engine.tokenizer, content_filter)
        self.limits.check_prompt_tokens([len(p.token_ids) for p in self.prompts])
        self.on_started: Callable[[int], None] = _ignore  # told when a prompt's first engine output arrives
        self.meta = CompletionMeta(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.model_name,
            system_fingerprint=engine.system_fingerprint,
        )
        width, echo, ids = self.params.n, bool(request.echo), bool(request.return_token_ids)
        self.choices = [
            Choice(p * width + j, prompt, echo, self._builder(prompt), ids, request.prompt_logprobs)
            for p, prompt in enumerate(self.prompts)
            for j in range(width)
        ]

    @property
    def token_budget(self) -> int:
        """The most tokens this request can use: its prompts and max_tokens for every sequence (what a token rate
        limit charges up front; usage's total_tokens is what it used)."""
        return sum(len(p.token_ids) for p in self.prompts) + self.params.max_tokens * len(self.choices)

    def _builder(self, prompt: Prompt) -> LogprobsBuilder | None:
        """Without echo, OpenAI's text_offset counts from the prompt's start: the first token's is the prompt's length."""
        if self.request.logprobs is None:
            return None
        return LogprobsBuilder(self.request.logprobs, start=0 if self.request.echo else len(prompt.text))

    async def response(self) -> dict[str, Any]:
        try:
            async with aclosing(self._outputs()) as outputs:
                async for prompt_index, output in outputs:
                    self._apply(prompt_index, output)
        except APIError as exc:
            self.error = exc
            raise
        except Exception:
            self.error = server_error()
            raise
        self.finished = True
        return protocol.completion_response(self.meta, self._returned_choices(), self.usage())

    async def frames(self) -> AsyncGenerator[str, None]:
        """The SSE stream: chunks, the usage chunk when asked for, an error frame if it fails, then [DONE]."""
        with_usage = self.request.include_usage
        try:
            async with aclosing(self._outputs()) as outputs:
                async for prompt_index, output in outputs:
                    for piece in self._apply(prompt_index, output):
                        yield sse.data(self._chunk([piece], with_usage))
            self.finished = True
            if with_usage:
                yield sse.data(protocol.completion_chunk(self.meta, [], self.usage(), True))
        except APIError as exc:
            self.error = exc
            yield sse.error_frame(exc)
        except Exception:
            logger.exception("completion %s failed while streaming", self.meta.id)
            self.error = server_error()
            yield sse.error_frame(self.error)
        yield sse.DONE

    def _chunk(self, choices: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
        chunk = protocol.completion_chunk(self.meta, choices, None, with_usage)
        if self.request.include_obfuscation:  # pads chunk sizes so their lengths do not reveal the tokens
            chunk["obfuscation"] = secrets.token_urlsafe(1 + secrets.randbelow(16))
        return chunk

    def _apply(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        if output.error is not None:
            if not self.engine.is_healthy():
                raise service_unavailable("The engine stopped while serving this request; please retry.", RETRY_AFTER_S)
            raise server_error(f"The engine failed on this request: {output.error}")
        self.on_started(prompt_index)
        prompt = self.prompts[prompt_index]
        prompt.saw(output, time.monotonic())
        prompt.cached_tokens = max(prompt.cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            prompt.logprobs = output.prompt_logprobs
        width = self.params.n
        mine = self.choices[prompt_index * width : (prompt_index + 1) * width]
        pieces = [piece for delta in output.deltas if (piece := mine[delta.index].update(delta)) is not None]
        if output.finished:
            pieces += [c.finish_without_delta(self.params.max_tokens) for c in mine if c.finish_reason is None]
        return pieces

    def _returned_choices(self) -> list[dict[str, Any]]:
        """Per prompt, the n choices; with best_of, the n best by mean token logprob, re-indexed."""
        n, width, result = self.request.num_choices, self.params.n, []
        for p in range(len(self.prompts)):
            candidates = self.choices[p * width : (p + 1) * width]
            if width > n:
                candidates = sorted(candidates, key=lambda c: -c.mean_logprob)[:n]
            for j, c in enumerate(candidates):
                c.index, c.sent_prompt_extras = p * n + j, False
                result.append(c.piece("".join(c.text), c.logprobs, c.token_ids))
        return result

    def usage(self) -> dict[str, Any]:
        return protocol.usage(
            prompt_tokens=sum(len(p.token_ids) for p in self.prompts),
            completion_tokens=sum(c.num_tokens for c in self.choices),
            cached_tokens=sum(p.cached_tokens for p in self.prompts),
        )

    def record(self, with_text: bool = False) -> CompletionRecord:
        """What this completion did, for the metrics and the access log; `with_text`: with prompt and outputs."""
        width = self.params.n
        error = self.error
        return CompletionRecord(
            model=self.meta.model,
            completion_id=self.meta.id,
            stream=bool(self.request.stream),
            prompts=[
                self._prompt_record(p, self.choices[i * width : (i + 1) * width]) for i, p in enumerate(self.prompts)
            ],
            finish_reasons=[c.finish_reason for c in self.choices if c.finish_reason is not None],
            outcome=self.outcome,
            error_status=error.status if error is not None else None,
            error_code=error.code if error is not None else None,
            user=pseudonym(self.request.user) if self.request.user is not None else None,
            prompt=self.request.prompt if with_text else None,
            outputs=["".join(c.text) for c in self.choices] if with_text else None,
        )

    @property
    def outcome(self) -> str:
        if self.error is not None:
            return "timeout" if self.error.code == REQUEST_TIMEOUT else "error"
        return "ok" if self.finished else "client_gone"

    def _prompt_record(self, prompt: Prompt, choices: list[Choice]) -> PromptRecord:
        longest = max((c.num_tokens for c in choices), default=0)
        return PromptRecord(
            prompt_tokens=len(prompt.token_ids),
            cached_tokens=prompt.cached_tokens,
            completion_tokens=sum(c.num_tokens for c in choices),
            started=prompt.started_at is not None,
            admission_wait_s=_since(self.admitted_at, prompt.started_at),
            ttft_s=_since(self.arrived_at, prompt.first_token_at),
            tpot_s=_per_token(prompt.first_token_at, prompt.last_token_at, longest - 1),
            e2e_s=_since(self.arrived_at, prompt.finished_at),
        )

    def _outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        generators = [
            self.engine.generate(f"{self.meta.id}-{i}", prompt.token_ids, self._params_for(prompt))
            for i, prompt in enumerate(self.prompts)
        ]
        return merge(generators, self.limits.timeout_s)

    def _params_for(self, prompt: Prompt) -> SamplingParams:
        """With echo a choice's text starts with its prompt: the content filter reads the output after it."""
        if self.params.content_filter is None or not self.request.echo:
            return self.params
        return dataclasses.replace(self.params, content_filter_context=prompt.text)


def _ignore(prompt_index: int) -> None:
    pass


def check_content(
    request: CompletionRequest, prompts: list[Prompt], tokenizer: Tokenizer, content_filter: ContentFilter
) -> None:
    """A prompt (as text, token-id prompts decoded) or suffix that the server's content filter matches: a 400."""
    for prompt in prompts:
        text = prompt.text or tokenizer.decode(prompt.token_ids[prompt.hidden :])
        if content_filter.matches(text):
            raise invalid_request(_FILTERED.format("prompt"), "prompt", "content_filter")
    if request.suffix and content_filter.matches(request.suffix):
        raise invalid_request(_FILTERED.format("suffix"), "suffix", "content_filter")


_FILTERED = "The {} contains text that this server's content filter does not allow."


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _per_token(first: float | None, last: float | None, gaps: int) -> float | None:
    span = _since(first, last)
    return None if span is None or gaps < 1 else span / gaps


def _check_something_is_allowed(params: SamplingParams, tokenizer: Tokenizer) -> None:
    """allowed_token_ids that the first step's bans cover whole (EOS and stop tokens before min_tokens, one-token bad
    words) leave nothing to sample: a 400 now, not a failure mid-generation."""
    if params.allowed_token_ids is None:
        return
    banned = {word[0] for word in params.bad_words_ids if len(word) == 1}
    if params.min_tokens > 0:
        eos = () if params.ignore_eos else getattr(tokenizer, "eos_ids", (tokenizer.eos_id,))
        banned |= {*eos, *params.stop_token_ids}
    if set(params.allowed_token_ids) <= banned:
        raise invalid_request(
            "'allowed_token_ids' are all excluded by 'bad_words' or, before 'min_tokens', as end tokens",
            "allowed_token_ids",
        )


def bad_words_ids(words: Sequence[str], engine: Engine) -> tuple[tuple[int, ...], ...]:
    """Each bad word's tokens as it would appear at the start of the text and after a space (vLLM's rule: a
    tokenizer spells a word differently there), without duplicates."""
    variants: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(engine.tokenizer.encode(text, add_special_tokens=False))
            if ids:
                variants[ids] = None
    return tuple(variants)


# --- running prompts concurrently -----------------------------------------------------------------------------------
_END = object()


async def merge(
    generators: list[AsyncIterator[RequestOutput]], timeout_s: float | None = None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(generator index, item) as items arrive from any generator. Closing this closes them all (engine abort).

    Past `timeout_s` it raises the request-timeout APIError, which closes them all too.
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    async def pump(index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in generator:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer; cancellation is not an Exception
            queue.put_nowait((index, exc))
        finally:
            aclose = getattr(generator, "aclose", None)
            if aclose is not None:
                await aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    try:
        running = len(tasks)
        while running:
            index, item = await _next(queue, deadline, timeout_s)
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next(queue: asyncio.Queue[T], deadline: float | None, timeout_s: float | None) -> T:
    if deadline is None or timeout_s is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), deadline - asyncio.get_running_loop().time())
    except TimeoutError:
        raise request_timeout(timeout_s) from None
