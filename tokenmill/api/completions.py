"""POST /v1/completions: prompts × n (× best_of) → engine requests → one response or an SSE stream.

The prompts are prepared (and every 400 raised) in prompts.py; each choice's progress is a Choice (choice.py).

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from tokenmill.api import protocol, sse
from tokenmill.api.admission import RETRY_AFTER_S
from tokenmill.api.beam_search import BeamSearch, beam_search
from tokenmill.api.choice import Choice
from tokenmill.api.engine_protocol import Engine, Tokenizer
from tokenmill.api.errors import (
    REQUEST_TIMEOUT,
    APIError,
    engine_lost,
    invalid_request,
    request_timeout,
    server_error,
    service_unavailable,
)
from tokenmill.api.limits import RequestLimits
from tokenmill.api.logprobs import LogprobsBuilder, TokenView
from tokenmill.api.prompts import (
    Prompt,
    bad_words_ids,
    check_content,
    prepare_prompts,
    prompt_items,
)
from tokenmill.api.protocol import CompletionMeta, CompletionRequest
from tokenmill.api.record import CompletionRecord, PromptRecord, pseudonym
from tokenmill.engine import guided
from tokenmill.engine.content_filter import ContentFilter
from tokenmill.engine.guided import GuideError
from tokenmill.engine.outputs import AdapterInfo, RequestOutput
from tokenmill.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


# --- one request ----------------------------------------------------------------------------------------------------
class Completion:
    def __init__(
        self,
        request: CompletionRequest,
        engine: Engine,
        limits: RequestLimits | None = None,
        content_filter: ContentFilter | None = None,
        arrived_at: float | None = None,
        bos_before_ids: bool = False,
        tenant: str | None = None,
        adapter: AdapterInfo | None = None,
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
        if tenant is not None:
            self.params = dataclasses.replace(self.params, tenant=tenant)
        if adapter is not None:  # a LoRA adapter served beside the engine's model (request.model names it)
            self.params = dataclasses.replace(self.params, adapter=adapter.name)
        if request.suffix and engine.tokenizer.supports_fim:  # a filled-in middle ends at the model's end tokens
            ends = self.params.stop_token_ids + engine.tokenizer.fim_end_ids
            self.params = dataclasses.replace(self.params, stop_token_ids=ends)
        if request.bad_words:
            self.params = dataclasses.replace(
                self.params, bad_words_ids=bad_words_ids(request.bad_words, engine.tokenizer)
            )
        _check_something_is_allowed(self.params, engine.tokenizer)
        if self.params.guide is not None:
            try:
                guided.check(self.params.guide, engine.tokenizer)
            except GuideError as exc:
                raise _unusable_guide(request, str(exc)) from None
        self.limits.check_counts(len(prompt_items(request.prompt)), self.params.n)
        capped = self.limits.capped(engine.tokenizer, request, engine.max_model_len)  # stops at the limits
        beam = request.beam_search
        self.beam = BeamSearch(*beam) if beam is not None else None
        if self.beam is not None:  # the search keeps its beams itself: the engine sees one sequence at a time
            self.params = dataclasses.replace(self.params, n=request.num_choices)
        self.prompts = prepare_prompts(request, capped, engine.max_model_len, self.params.max_tokens, bos_before_ids)
        if content_filter is not None:
            check_content(request, self.prompts, engine.tokenizer, content_filter)
        self.limits.check_prompt_tokens([len(p.token_ids) for p in self.prompts])
        self.limits.check_response(request, self.prompts)
        self.on_started: Callable[[int], None] = _ignore  # told when a prompt's first engine output arrives
        self.meta = CompletionMeta(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=adapter.name if adapter else engine.model_name,
            system_fingerprint=adapter.system_fingerprint if adapter else engine.system_fingerprint,
        )
        # the engine shares its steps fairly between requests: every prompt and choice of this one is one turn
        self.params = dataclasses.replace(self.params, fairness_key=self.meta.id)
        width, echo, ids = self.params.n, bool(request.echo), bool(request.return_token_ids)
        view = TokenView(
            engine.tokenizer,
            self.params.skip_special_tokens,
            self.params.content_filter,
            bool(request.return_tokens_as_token_ids),
        )
        self.choices = [
            Choice(p * width + j, prompt, echo, self._builder(prompt, view), ids, request.prompt_logprobs, view)
            for p, prompt in enumerate(self.prompts)
            for j in range(width)
        ]
        self._generators: list[AsyncIterator[RequestOutput]] | None = None  # the engine's outputs, once started

    @property
    def token_budget(self) -> int:
        """The most tokens this request can use: its prompts and max_tokens for every sequence (what a token rate
        limit charges up front; usage's total_tokens is what it used)."""
        return sum(len(p.token_ids) for p in self.prompts) + self.params.max_tokens * len(self.choices)

    def _builder(self, prompt: Prompt, view: TokenView) -> LogprobsBuilder | None:
        """Without echo, OpenAI's text_offset counts from the prompt's start: the first token's is the prompt's length."""
        if self.request.logprobs is None:
            return None
        start = 0 if self.request.echo else len(prompt.text)
        return LogprobsBuilder(self.request.logprobs, view, prompt.token_ids, start=start)

    async def response(self) -> dict[str, Any]:
        try:
            async with aclosing(self._outputs()) as outputs:
                async for prompt_index, output in outputs:
                    await self._take(prompt_index, output)
        except APIError as exc:
            self.error = exc
            raise
        except Exception:
            self.error = server_error()
            raise
        self.finished = True
        if self.echoes_prompt:  # every choice's echo and prompt logprobs, written out: off the event loop
            return await asyncio.to_thread(self._response)
        return self._response()

    def _response(self) -> dict[str, Any]:
        return protocol.completion_response(self.meta, self._returned_choices(), self.usage())

    @property
    def echoes_prompt(self) -> bool:
        """Each choice carries its prompt (echo, prompt_logprobs): work and bytes that grow with prompt × n."""
        return bool(self.request.echo) or self.request.prompt_logprobs is not None

    async def frames(self) -> AsyncGenerator[str, None]:
        """The SSE stream: chunks, the usage chunk when asked for, an error frame if it fails, then [DONE]."""
        with_usage = self.request.include_usage
        try:
            async with aclosing(self._outputs()) as outputs:
                async for prompt_index, output in outputs:
                    for piece in await self._take(prompt_index, output):
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
        so_far = self._choice_usage(choices[0]["index"]) if self.request.continuous_usage else None
        chunk = protocol.completion_chunk(self.meta, choices, so_far, with_usage)
        if self.request.include_obfuscation:  # pads chunk sizes so their lengths do not reveal the tokens
            chunk["obfuscation"] = secrets.token_urlsafe(1 + secrets.randbelow(16))
        return chunk

    async def _take(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """_apply; a prompt's first output, which brings every choice its echoed prompt or prompt logprobs, is folded
        in on a worker thread, so the event loop serves other requests meanwhile."""
        if not self.echoes_prompt or self.prompts[prompt_index].started_at is not None:
            return self._apply(prompt_index, output)
        self._raise_for(output)
        self.on_started(prompt_index)
        return await asyncio.to_thread(self._fold, prompt_index, output)

    def _apply(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self._raise_for(output)
        self.on_started(prompt_index)
        return self._fold(prompt_index, output)

    def _raise_for(self, output: RequestOutput) -> None:
        if output.error is not None:
            if output.lost:
                raise engine_lost()
            if output.grammar_failed:  # the grammar passed its check but outgrew the matcher as the text grew
                raise _unusable_guide(self.request, output.error)
            if not self.engine.is_healthy():
                raise service_unavailable("The engine stopped while serving this request; please retry.", RETRY_AFTER_S)
            raise server_error(f"The engine failed on this request: {guided.reason(output.error)}")

    def _fold(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
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

    def _choice_usage(self, index: int) -> dict[str, Any]:
        """A streamed choice's usage so far, as vLLM's continuous_usage_stats gives it: its prompt's tokens and its own
        completion tokens."""
        prompt = self.prompts[index // self.params.n]
        return protocol.usage(
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=self.choices[index].num_tokens,
            cached_tokens=prompt.cached_tokens,
        )

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

    def start(self) -> list[AsyncIterator[RequestOutput]]:
        """Hands the prompts to the engine now (once) and returns their outputs. The engine's own one (AsyncEngine)
        queues each at once, so a burst's requests reach it as each is admitted, not once the event loop has started
        each one's response; the outputs are read when the response is."""
        if self._generators is None:
            self._generators = [self._generate(f"{self.meta.id}-{i}", prompt) for i, prompt in enumerate(self.prompts)]
        return self._generators

    def _generate(self, request_id: str, prompt: Prompt) -> AsyncIterator[RequestOutput]:
        params = self._params_for(prompt)
        if self.beam is None:
            return self.engine.generate(request_id, prompt.token_ids, params)
        return beam_search(self.engine, request_id, prompt.token_ids, params, self.beam)

    def close(self) -> None:
        """Whatever of it still runs in the engine is aborted (a stream whose client left before it began reading;
        a read to the end, or closed, leaves nothing)."""
        for generator in self._generators or ():
            close = getattr(generator, "close", None)
            if close is not None:
                close()

    def _outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        return merge(self.start(), self.limits.timeout_s)

    def _params_for(self, prompt: Prompt) -> SamplingParams:
        """With echo a choice's text starts with its prompt: the content filter reads the output after it."""
        if self.params.content_filter is None or not self.request.echo:
            return self.params
        return dataclasses.replace(self.params, content_filter_context=prompt.text)


async def prepare_guides(request: CompletionRequest, engine: Engine) -> None:
    """A request with a constraint needs llguidance's view of the tokenizer, built once per model (seconds for a
    large vocabulary): built on a worker thread, so the event loop keeps serving every other stream meanwhile."""
    if request.structured_outputs is None and request.response_format is None:
        return
    try:
        await asyncio.to_thread(guided.ll_tokenizer, engine.tokenizer)
    except GuideError:
        pass  # Completion's own check turns it into the 400 that names the field


def _unusable_guide(request: CompletionRequest, why: str) -> APIError:
    param = "structured_outputs" if request.structured_outputs is not None else "response_format"
    return invalid_request(f"'{param}' cannot be used: {guided.reason(why)}", param)


def _ignore(prompt_index: int) -> None:
    pass


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
        eos = () if params.ignore_eos else tokenizer.eos_ids
        banned |= {*eos, *params.stop_token_ids}
    if set(params.allowed_token_ids) <= banned:
        raise invalid_request(
            "'allowed_token_ids' are all excluded by 'bad_words' or, before 'min_tokens', as end tokens",
            "allowed_token_ids",
        )


# --- running prompts concurrently -----------------------------------------------------------------------------------
_END = object()


async def merge(
    generators: list[AsyncIterator[RequestOutput]], timeout_s: float | None = None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(generator index, item) as items arrive from any generator. Closing this closes them all (engine abort).

    Past `timeout_s` it raises the request-timeout APIError, which closes them all too.
    """
    if len(generators) == 1 and timeout_s is None:  # one prompt, no deadline: no task and queue between
        generator = generators[0]
        try:
            async for item in generator:
                yield 0, item
        finally:
            await _aclose(generator)
        return
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
            await _aclose(generator)

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


async def _aclose(generator: AsyncIterator[RequestOutput]) -> None:
    """Close an engine's outputs (an abort if they had not ended), where the iterator can be closed."""
    aclose = getattr(generator, "aclose", None)
    if aclose is not None:
        await aclose()


async def _next(queue: asyncio.Queue[T], deadline: float | None, timeout_s: float | None) -> T:
    if deadline is None or timeout_s is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), deadline - asyncio.get_running_loop().time())
    except TimeoutError:
        raise request_timeout(timeout_s) from None
