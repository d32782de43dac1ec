"""A deterministic stand-in for AsyncEngine: a char-level tokenizer and scripted generations.

Sequence j of a request writes SCRIPT rotated left by j characters, one token per step, then EOS. Its chosen-token
logprob is -1/(j+1) per token, so with best_of the last candidate has the highest mean logprob. Stop strings cut the
text (never shown, like the real engine's hold-back); max_tokens ends with "length". Failure modes are switches.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenmill.engine.outputs import (
    AdapterInfo,
    AdapterLoadError,
    EngineDescription,
    FinishReason,
    RequestOutput,
    SequenceDelta,
    StepReport,
    TokenLogprob,
)
from tokenmill.engine.sampling import SamplingParams

SCRIPT = "The quick brown fox jumps over the lazy dog."
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
ALT_TEXTS = ("A", "A", "B", "C", "D")  # top-k alternatives; "A" twice: two ids may share a text


class CharTokenizer:
    pad_id, bos_id, eos_id = 0, 1, 2
    eos_ids = (2,)
    pad_token, bos_token, eos_token = SPECIALS
    add_bos = True
    vocab_size = len(SPECIALS) + len(CHARS)
    supports_fim = False  # the fast tier's FIM tests run the real engine on tiny FIM tokenizers
    fim_end_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        raise ValueError("no fill-in-the-middle tokens")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            special = next((s for s in SPECIALS if text.startswith(s, i)), None)
            if special is not None:
                ids.append(SPECIALS.index(special))
                i += len(special)
            else:
                ids.append(len(SPECIALS) + CHARS.index(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.id_to_token(i) for i in ids if not (skip_special_tokens and i < len(SPECIALS)))

    def id_to_token(self, token_id: int) -> str:
        return SPECIALS[token_id] if token_id < len(SPECIALS) else CHARS[token_id - len(SPECIALS)]


def scripted_text(j: int) -> str:
    return SCRIPT[j % len(SCRIPT) :] + SCRIPT[: j % len(SCRIPT)]


def token_logprob(j: int) -> float:
    return -1.0 / (j + 1)


@dataclass
class FakeStats:
    requests: int
    aborted: int


@dataclass
class _Seq:
    index: int
    token_ids: list[int]
    texts: list[str]  # visible text per token ("" for EOS and for tokens inside a stop string)
    finish: FinishReason
    step: int = 0
    cumulative: float = 0.0


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    max_model_len: int = 128
    system_fingerprint: str = "fp_fake"
    cached_tokens: int = 0
    healthy: bool = True
    error_at_step: int | None = None  # yield a RequestOutput with `error` at this step
    raise_at_step: int | None = None  # raise RuntimeError at this step
    hang_at_step: int | None = None  # wait forever at this step (the client has to give up)
    abort_at_step: int | None = None  # finish every sequence with FinishReason.ABORT at this step
    omit_final_deltas: bool = False  # finish the request without the sequences' final deltas
    lose_at_step: int | None = None  # the engine is lost (a replica died) at this step: an output marked `lost`
    losses_left: int = 1  # how many generate calls lose_at_step applies to
    neg_inf_alternative: bool = False  # one top-k alternative has logprob -inf
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    description: EngineDescription | None = None  # the banner names only the model and its context
    requests: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    lifecycle: list[str] = field(default_factory=list)
    step_observers: list[Callable[[StepReport], None]] = field(default_factory=list)  # told of no step: it runs none

    def is_healthy(self) -> bool:
        return self.healthy

    def health(self) -> dict[str, int] | None:  # one engine, no replicas (ReplicatedEngine has some)
        return None

    async def refresh(self) -> None:
        pass

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        self.step_observers.append(observe)

    async def start(self) -> None:  # the app's lifespan starts an engine that is not running yet
        self.healthy = True
        self.lifecycle.append("start")

    async def stop(self) -> None:
        self.lifecycle.append("stop")

    def stats(self) -> FakeStats:
        return FakeStats(requests=len(self.requests), aborted=len(self.aborted))

    def adapters(self) -> list[AdapterInfo]:
        return []

    async def load_adapter(self, name: str, path: str) -> None:
        raise AdapterLoadError("the fake engine serves no adapters")

    async def unload_adapter(self, name: str) -> None:
        raise KeyError(name)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.requests.append((request_id, list(prompt_token_ids), params))
        done = False
        try:
            seqs = [self._plan(j, params) for j in range(params.n)]
            first = True
            for step in range(max((len(s.token_ids) for s in seqs), default=0) + 1):
                await asyncio.sleep(0)
                if step == self.hang_at_step:
                    await asyncio.Event().wait()
                if step == self.raise_at_step:
                    raise RuntimeError("fake engine crashed")
                if step == self.lose_at_step and self.losses_left > 0:
                    self.losses_left -= 1
                    yield RequestOutput(
                        request_id, [], prompt_token_ids, error="replica lost", finished=True, lost=True
                    )
                    done = True
                    return
                if step == self.error_at_step:
                    yield RequestOutput(request_id, [], prompt_token_ids, error="fake engine failure", finished=True)
                    done = True
                    return
                deltas = [d for s in seqs if (d := self._advance(s, params, step)) is not None]
                finished = all(s.step >= len(s.token_ids) for s in seqs)
                if finished and self.omit_final_deltas:
                    deltas = [d for d in deltas if d.finish_reason is None]
                output = RequestOutput(
                    request_id,
                    deltas,
                    list(prompt_token_ids),
                    num_cached_tokens=min(self.cached_tokens, len(prompt_token_ids)),
                    prompt_logprobs=self._prompt_logprobs(prompt_token_ids, params) if first else None,
                    finished=finished,
                )
                first = False
                yield output
                if finished:
                    break
            done = True
            self.completed.append(request_id)
        finally:
            if not done:
                self.aborted.append(request_id)

    def _plan(self, j: int, params: SamplingParams) -> _Seq:
        text = scripted_text(j)
        cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:  # the stop string's tokens are generated, its text never shown
            stop = next(s for s in params.stop if text.find(s) == cut)
            chars, visible = text[: cut + len(stop)], cut
        else:
            chars, visible = text, len(text)
        ids = self.tokenizer.encode(chars, add_special_tokens=False) + ([] if cut >= 0 else [CharTokenizer.eos_id])
        texts = [c if i < visible else "" for i, c in enumerate(chars)] + ([] if cut >= 0 else [""])
        finish = FinishReason.STOP
        if len(ids) > params.max_tokens:
            ids, texts, finish = ids[: params.max_tokens], texts[: params.max_tokens], FinishReason.LENGTH
        return _Seq(j, ids, texts, finish)

    def _advance(self, seq: _Seq, params: SamplingParams, step: int) -> SequenceDelta | None:
        if seq.step >= len(seq.token_ids) and not (step == 0 and not seq.token_ids):
            return None
        if step == self.abort_at_step:
            seq.step = len(seq.token_ids)
            return SequenceDelta(seq.index, "", [], None, FinishReason.ABORT, seq.cumulative, seq.step)
        if not seq.token_ids:  # max_tokens 0: finished before the first token
            return SequenceDelta(seq.index, "", [], [] if params.logprobs is not None else None, seq.finish)
        token_id, text, logprob = seq.token_ids[seq.step], seq.texts[seq.step], token_logprob(seq.index)
        seq.step += 1
        seq.cumulative += logprob
        finish = seq.finish if seq.step == len(seq.token_ids) else None
        logprobs = None
        if params.logprobs is not None:
            token_text = self.tokenizer.decode([token_id], skip_special_tokens=True)
            logprobs = [TokenLogprob(token_id, token_text, logprob, self._alternatives(logprob, params.logprobs))]
        return SequenceDelta(seq.index, text, [token_id], logprobs, finish, seq.cumulative, seq.step)

    def _alternatives(self, logprob: float, k: int) -> list[tuple[int, str, float]]:
        alts = [(10 + i, text, logprob + 0.5 - i) for i, text in enumerate(ALT_TEXTS[:k])]
        if self.neg_inf_alternative and alts:
            alts[-1] = (99, "Z", -math.inf)
        return alts

    def _prompt_logprobs(self, ids: list[int], params: SamplingParams) -> list[TokenLogprob] | None:
        if params.prompt_logprobs is None:
            return None
        k = params.prompt_logprobs
        entries = []
        for i, token_id in enumerate(ids):
            text = self.tokenizer.decode([token_id])
            logprob = None if i == 0 else -2.0
            entries.append(TokenLogprob(token_id, text, logprob, [] if i == 0 else self._alternatives(-2.0, k)))
        return entries


@dataclass
class ReplicatedEngine(FakeEngine):
    """A FakeEngine that reports replicas as cluster/'s RemoteEngine does, refreshed before /health answers."""

    replicas: int = 2
    target_replicas: int = 2
    refreshes: int = 0

    async def refresh(self) -> None:
        self.refreshes += 1

    def health(self) -> dict[str, int]:
        return {"replicas": self.replicas, "target_replicas": self.target_replicas}
