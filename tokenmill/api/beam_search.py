"""Beam search (vLLM's `use_beam_search`): the likeliest continuations by cumulative log-probability, `width` of them
kept at each step, the best `n` returned.

Each step asks the engine for one token of every live beam, with its 2 × width likeliest alternatives (the model's
own log-probabilities). Those requests run in one engine batch and share the prompt's and the beams' common prefixes
through the prefix cache, so a step computes little more than each beam's tokens since its last full cache block.
This is how vLLM runs it too. The search hands back one RequestOutput at its end, in the shape of the engine's own,
so echo, logprobs, streaming and usage work as for any completion.

A beam ends at an end token (EOS, unless ignore_eos, or a stop token id) or a stop string; finished beams are ranked
with the live ones at the end by cumulative log-probability / generated length ** length_penalty, the end token
counted, as `transformers` scores them (vLLM leaves the end token out and counts the prompt). The search stops early,
as `transformers`' does by default, once `width` beams have finished and no live beam can score better than the
worst of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tokenmill.api.engine_protocol import Engine
from tokenmill.api.logprobs import InContext
from tokenmill.engine.outputs import FinishReason, RequestOutput, SequenceDelta, TokenLogprob
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.stop import StopChecker


@dataclass(frozen=True)
class BeamSearch:
    width: int  # beams kept each step: max(n, best_of)
    length_penalty: float = 1.0


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...] = ()
    steps: tuple[TokenLogprob, ...] = ()  # per token: its logprob and the alternatives of its step
    cumulative: float = 0.0
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    text: str = ""  # with a stop string: the text up to it (or through it); otherwise decoded at the end

    def grown(self, step: TokenLogprob) -> Beam:
        assert step.logprob is not None
        return Beam(self.token_ids + (step.token_id,), self.steps + (step,), self.cumulative + step.logprob)

    def score(self, length_penalty: float) -> float:
        return self.cumulative / max(len(self.token_ids), 1) ** length_penalty


def beam_search(
    engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams, search: BeamSearch
) -> BeamSearchOutputs:
    """One prompt's beam search, started when its outputs are first read."""
    return BeamSearchOutputs(_Search(engine, request_id, prompt_ids, params, search).output)


class BeamSearchOutputs:
    """The engine outputs of one prompt's beam search: one RequestOutput, at the end. close() aborts the search."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, RequestOutput]]) -> None:
        self._run = run
        self._task: asyncio.Task[RequestOutput] | None = None
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        try:
            return await asyncio.shield(self._task)  # a cancelled reader (a timeout) leaves close() to end it
        finally:
            self._done = self._task.done()

    def close(self) -> None:
        self._done = True
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """close(), then wait until the search has closed its engine requests (they are aborted)."""
        self.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


class _Search:
    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        search: BeamSearch,
    ) -> None:
        self.engine, self.request_id, self.prompt_ids = engine, request_id, list(prompt_ids)
        self.params, self.search, self.content_filter = params, search, params.content_filter
        self.ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.tokenizer.eos_ids))
        # one token of the model's own distribution and its alternatives: nothing of the request's own ending rules
        self.step_params = dataclasses.replace(
            params,
            n=1,
            max_tokens=1,
            temperature=0.0,
            logprobs=2 * search.width,
            prompt_logprobs=None,
            stop=(),
            stop_token_ids=(),
            ignore_eos=True,
            content_filter=None,
            seed=None,
        )

    async def output(self) -> RequestOutput:
        live, done = [Beam()], []
        first: RequestOutput | None = None
        for step in range(self.params.max_tokens):
            outputs = await asyncio.gather(*(self._next(beam, step, i) for i, beam in enumerate(live)))
            failed = next((o for o in outputs if o.error is not None), None)
            if failed is not None:
                return dataclasses.replace(failed, request_id=self.request_id, prompt_token_ids=self.prompt_ids)
            first = first or outputs[0]
            live, ended = self._advance(live, [_step_entry(o) for o in outputs])
            done += ended
            if not live or self._settled(live, done):
                break
        if first is None:  # max_tokens 0: the prompt alone (its logprobs, for echo)
            prompt_only = dataclasses.replace(self._first_params(), max_tokens=0)
            first = await self._collect(self.prompt_ids, prompt_only, f"{self.request_id}-prompt")
            if first.error is not None:
                return first
        finals = done + [dataclasses.replace(b, finish=FinishReason.LENGTH) for b in live]
        return self._result(first, finals)

    async def _next(self, beam: Beam, step: int, index: int) -> RequestOutput:
        params = self._first_params() if step == 0 else self.step_params
        return await self._collect(self.prompt_ids + list(beam.token_ids), params, f"{self.request_id}-{step}-{index}")

    def _first_params(self) -> SamplingParams:
        """The first step also scores the prompt, when echo or prompt_logprobs want it."""
        return dataclasses.replace(self.step_params, prompt_logprobs=self.params.prompt_logprobs)

    async def _collect(self, ids: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
        """One engine request to its end, its outputs folded into one."""
        merged: RequestOutput | None = None
        deltas: list[SequenceDelta] = []
        async with aclosing(_aiter(self.engine.generate(request_id, ids, params))) as outputs:
            async for output in outputs:
                merged = merged or output
                deltas += output.deltas
                if output.error is not None:
                    return output
        assert merged is not None
        return dataclasses.replace(merged, deltas=deltas, finished=True)

    def _advance(self, live: list[Beam], entries: list[TokenLogprob]) -> tuple[list[Beam], list[Beam]]:
        """Every beam's candidates, likeliest first: the first `width` that go on are the next beams; an end among
        the first `width` finishes a beam (one further down would not have been kept anyway)."""
        width = self.search.width
        candidates = [
            (beam, TokenLogprob(token_id, text, logprob, entry.top))
            for beam, entry in zip(live, entries, strict=True)
            for token_id, text, logprob in entry.top
        ]
        candidates.sort(key=lambda c: -(c[0].cumulative + (c[1].logprob or 0.0)))
        going: list[Beam] = []
        ended: list[Beam] = []
        for rank, (beam, entry) in enumerate(candidates):
            if len(going) == width:
                break
            grown = beam.grown(entry)
            finished = self._finished(grown)
            if finished is None:
                if not self._filtered(grown):
                    going.append(grown)
            elif rank < width:
                ended.append(finished)
        return going, ended

    def _finished(self, beam: Beam) -> Beam | None:
        """The beam as it ends here (an end token or a stop string), or None when it goes on."""
        token = beam.token_ids[-1]
        if token in self.ends:
            reason = token if token in self.params.stop_token_ids else None
            return dataclasses.replace(beam, finish=FinishReason.STOP, stop_reason=reason)
        if self.params.stop:
            checker = StopChecker(self.params.stop, self.params.include_stop_str_in_output)
            text = checker.feed(self._decode(beam.token_ids))
            if checker.matched is not None:
                return dataclasses.replace(beam, finish=FinishReason.STOP, stop_reason=checker.matched, text=text)
        return None

    def _filtered(self, beam: Beam) -> bool:
        """With the server's content filter, a beam whose text it matches is not followed."""
        return self.content_filter is not None and self.content_filter.matches(self._decode(beam.token_ids))

    def _settled(self, live: list[Beam], done: list[Beam]) -> bool:
        """`width` beams have finished and no live one can beat the worst of the best `width` of them: a live beam's
        cumulative log-probability only falls (Hugging Face's early stop, without early_stopping)."""
        width, penalty = self.search.width, self.search.length_penalty
        if len(done) < width:
            return False
        worst = sorted((b.score(penalty) for b in done), reverse=True)[width - 1]
        return max(b.score(penalty) for b in live) <= worst

    def _decode(self, ids: tuple[int, ...]) -> str:
        return self.engine.tokenizer.decode(list(ids), skip_special_tokens=self.params.skip_special_tokens)

    def _result(self, first: RequestOutput, beams: list[Beam]) -> RequestOutput:
        penalty = self.search.length_penalty
        best = sorted(beams, key=lambda b: -b.score(penalty))[: self.params.n]
        deltas = [self._delta(index, beam) for index, beam in enumerate(best)]
        return RequestOutput(
            self.request_id,
            deltas,
            self.prompt_ids,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
            finished=True,
        )

    def _delta(self, index: int, beam: Beam) -> SequenceDelta:
        """The beam as one choice: each token's text as the detokeniser releases it (so the texts join up to the
        choice's text), its alternatives cut to the `logprobs` asked for."""
        detok = InContext(self.engine.tokenizer, self.prompt_ids, self.params.skip_special_tokens)
        pieces = [detok.add(token) for token in beam.token_ids]
        if pieces:
            pieces[-1] += detok.flush()
        text = beam.text if isinstance(beam.stop_reason, str) else "".join(pieces)  # a stop string cut it
        k = self.params.logprobs
        logprobs = None
        if k is not None:
            logprobs = [
                dataclasses.replace(step, text=piece, top=step.top[:k])
                for step, piece in zip(beam.steps, pieces, strict=True)
            ]
        return SequenceDelta(
            index,
            text,
            list(beam.token_ids),
            logprobs,
            finish_reason=beam.finish,
            cumulative_logprob=beam.cumulative,
            num_tokens=len(beam.token_ids),
            stop_reason=beam.stop_reason,
        )


def _step_entry(output: RequestOutput) -> TokenLogprob:
    """The one token a step request generated, with its alternatives (the likeliest first)."""
    [delta] = [d for d in output.deltas if d.logprobs] or [output.deltas[-1]]
    assert delta.logprobs, "a beam step asks for logprobs"
    return delta.logprobs[0]


async def _aiter(outputs: AsyncIterator[RequestOutput]) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs as an async generator (so that aclosing closes them, aborting the request)."""
    try:
        async for output in outputs:
            yield output
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:
            close()
