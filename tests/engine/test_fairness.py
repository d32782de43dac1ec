"""One request's many prompts, many choices or grammar masks must not hold back a later request's two tokens: the
scheduler shares each step between requests, and the sampler does a request's mask work once, not once a row a step.

Each test submits the heavy request, runs a few steps, adds a bystander asking for two tokens, and counts the steps
until the bystander has both while the heavy request is still running; the heavy request must then still produce what
it produces alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.gemma_vocab import gemma_vocab_core, masks_per_step
from tests.engine.tiny import TOK, choice_tokens, greedy, run_all, tiny_core
from tokenmill.engine.core import EngineCore
from tokenmill.engine.guided import Guide
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import MAX_GUIDED_ROWS, fair_shares

STEPS_BEFORE = 2  # steps the heavy request runs alone before the bystander arrives
WITHIN = 4  # steps in which the bystander must finish


def bystander_steps(
    core: EngineCore, heavy: set[str], before: int = STEPS_BEFORE
) -> tuple[int, dict[str, list[RequestOutput]]]:
    """Runs `before` steps, adds the bystander, steps until it finishes; returns the steps it took and every
    output. Fails if a heavy request finished before the bystander did (the test would prove nothing)."""
    outputs: dict[str, list[RequestOutput]] = {}

    def step() -> None:
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)

    for _ in range(before):
        step()
    core.add_request("bystander", TOK.encode("hi"), greedy(2))
    for steps in range(1, 200):
        step()
        if any(out.finished for out in outputs.get("bystander", [])):
            break
    assert any(r in core.requests for r in heavy), "the heavy request ended first"
    for request_id, outs in run_all(core).items():
        outputs.setdefault(request_id, []).extend(outs)
    assert len(choice_tokens(outputs["bystander"])) == 2
    return steps, outputs


def test_a_request_of_many_prompts_does_not_hold_back_a_later_one() -> None:
    prompts = {f"many-{i}": [TOK.bos_id] + [4 + (i * 7 + j) % 250 for j in range(120)] for i in range(16)}
    params = greedy(1, fairness_key="many")  # one HTTP request's prompts share a key
    alone = tiny_core(num_kv_blocks=1024)
    for request_id, prompt in prompts.items():
        alone.add_request(request_id, prompt, params)
    expected = run_all(alone)
    core = tiny_core(num_kv_blocks=1024)
    for request_id, prompt in prompts.items():
        core.add_request(request_id, prompt, params)
    steps, outputs = bystander_steps(core, set(prompts))
    assert steps <= WITHIN
    assert {r: choice_tokens(outputs[r]) for r in prompts} == {r: choice_tokens(expected[r]) for r in prompts}


def test_choices_filling_the_running_set_do_not_keep_a_later_request_out() -> None:
    allowed = tuple(range(4, TOK.vocab_size)) * 64  # the API takes up to 2**20 ids, repeats and all
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=16, allowed_token_ids=allowed)
    alone = tiny_core()  # max_num_seqs 16: the choices fill the running set
    alone.add_request("wide", TOK.encode("wide"), params)
    expected = run_all(alone)["wide"]
    core = tiny_core()
    core.add_request("wide", TOK.encode("wide"), params)
    steps, outputs = bystander_steps(core, {"wide"})
    assert steps <= WITHIN
    assert [choice_tokens(outputs["wide"], j) for j in range(16)] == [choice_tokens(expected, j) for j in range(16)]


def test_a_full_cache_preempts_the_request_holding_most_not_the_newcomer() -> None:
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=8)
    alone = tiny_core()
    alone.add_request("wide", TOK.encode("wide"), params)
    expected = run_all(alone)["wide"]
    core = tiny_core(num_kv_blocks=24)  # the 8 choices outgrow it while the bystander runs
    core.add_request("wide", TOK.encode("wide"), params)
    preempted = core.scheduler.num_preemptions
    steps, outputs = bystander_steps(core, {"wide"}, before=12)
    assert steps <= WITHIN
    assert core.scheduler.num_preemptions > preempted
    assert [choice_tokens(outputs["wide"], j) for j in range(8)] == [choice_tokens(expected, j) for j in range(8)]


class CountedIds(tuple[int, ...]):
    """allowed_token_ids that count how often they are read whole."""

    reads = 0

    def __iter__(self) -> Iterator[int]:
        self.reads += 1
        return super().__iter__()


def test_allowed_token_ids_are_read_once_for_all_choices_and_steps() -> None:
    allowed = CountedIds(tuple(range(4, TOK.vocab_size)) * 16)
    core = tiny_core()
    core.add_request("wide", TOK.encode("wide"), SamplingParams(max_tokens=6, n=8, seed=1, allowed_token_ids=allowed))
    outs = run_all(core)["wide"]
    assert all(len(choice_tokens(outs, j)) == 6 for j in range(8))
    assert all(t in allowed for j in range(8) for t in choice_tokens(outs, j))
    assert allowed.reads == 1  # made into a mask once, for 8 choices × 6 steps


def test_one_requests_grammar_masks_are_shared_and_capped_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=9, n=16, guide=Guide("regex", "[a-z]+( [a-z]+)*"))
    alone = gemma_vocab_core()
    alone.add_request("masked", [2, 300, 301], params)
    expected = run_all(alone)["masked"]
    core = gemma_vocab_core()
    masks_in_step = masks_per_step(monkeypatch, core)
    core.add_request("masked", [2, 300, 301], params)
    steps, outputs = bystander_steps(core, {"masked"})
    assert steps <= WITHIN
    assert masks_in_step[0] == 1  # the prompt's step: all 16 choices forked from it are in one grammar state
    assert max(masks_in_step) <= MAX_GUIDED_ROWS
    assert [choice_tokens(outputs["masked"], j) for j in range(16)] == [choice_tokens(expected, j) for j in range(16)]


@pytest.mark.parametrize(
    ("demands", "capacity", "shares"),
    [
        ({"a": 64, "b": 3}, 64, {"a": 61, "b": 3}),  # a small demand is met whole
        ({"a": 10, "b": 10}, 7, {"a": 4, "b": 3}),  # the remainder to the first
        ({"a": 1, "b": 1, "c": 1}, 2, {"a": 1, "b": 1, "c": 0}),  # fewer than the groups: the first ones
        ({"a": 0, "b": 5}, 8, {"a": 0, "b": 5}),
        ({"a": 9, "b": 2, "c": 9}, 12, {"a": 5, "b": 2, "c": 5}),
    ],
)
def test_fair_shares_are_max_min_fair(demands: dict[str, int], capacity: int, shares: dict[str, int]) -> None:
    assert fair_shares(demands, capacity) == shares
