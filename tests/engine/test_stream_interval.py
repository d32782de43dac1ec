"""--stream-interval N: after its first token, a request's outputs come N tokens at a time (the end at once), the
same tokens, text and logprobs as one at a time; and `merged`, which joins two outputs of one request."""

from __future__ import annotations

import asyncio
import dataclasses

from tests.engine.tiny import TOK, greedy, tiny_core
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.outputs import FinishReason, RequestOutput, SequenceDelta, TokenLogprob, merged


def outputs(interval: int, max_tokens: int) -> list[RequestOutput]:
    engine = AsyncEngine(tiny_core(speculative="off"), "tiny", "fp_tiny", stream_interval=interval)  # a token a step
    params = dataclasses.replace(greedy(max_tokens, n=2), logprobs=1, ignore_eos=True)

    async def scenario() -> list[RequestOutput]:
        await engine.start()
        try:
            return [out async for out in engine.generate("r", TOK.encode("hello world"), params)]
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(scenario(), 60))


def joined(outs: list[RequestOutput], index: int) -> tuple[str, list[int], list[int]]:
    deltas = [d for out in outs for d in out.deltas if d.index == index]
    logprob_ids = [lp.token_id for d in deltas for lp in d.logprobs or []]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], logprob_ids


def test_outputs_come_n_tokens_at_a_time_after_the_first_with_the_same_content() -> None:
    one, four = outputs(1, 11), outputs(4, 11)
    assert [len(out.deltas[0].token_ids) for out in four] == [1, 4, 4, 2]  # the end goes at once
    assert len(one) == 11 and four[-1].finished and not any(out.finished for out in four[:-1])
    for index in (0, 1):
        assert joined(four, index) == joined(one, index)
        text, ids, logprob_ids = joined(four, index)
        assert text and ids == logprob_ids and len(ids) == 11
    assert four[-1].deltas[0].finish_reason == one[-1].deltas[0].finish_reason == FinishReason.LENGTH


def test_merged_joins_text_tokens_and_logprobs_and_keeps_the_later_finish() -> None:
    def delta(text: str, token: int, finish: FinishReason | None = None) -> SequenceDelta:
        logprob = TokenLogprob(token, text, -0.5)
        return SequenceDelta(0, text, [token], [logprob], finish, cumulative_logprob=-token, num_tokens=token)

    first = RequestOutput("r", [delta("a", 1)], [9, 9], num_cached_tokens=2)
    then = RequestOutput("r", [delta("b", 2, FinishReason.STOP), SequenceDelta(1, "x", [7], None)], [9, 9])
    both = merged(first, dataclasses.replace(then, finished=True))
    zero, one = both.deltas
    assert (zero.text, zero.token_ids, [lp.token_id for lp in zero.logprobs or []]) == ("ab", [1, 2], [1, 2])
    assert (zero.finish_reason, zero.num_tokens, zero.cumulative_logprob) == (FinishReason.STOP, 2, -2)
    assert (one.index, one.text) == (1, "x")
    assert both.finished and both.num_cached_tokens == 2
