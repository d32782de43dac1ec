"""Draftless speculative decoding (engine/speculation.py): drafts from text a sequence has seen, checked in the step
that computes its next token. A greedy request's tokens, text, logprobs and finish are what they are without it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.api.gemma_vocab import gemma_vocab_core, masks_per_step
from tests.engine.tiny import TOK, FixedCost, drafting_core, run_all, tiny_core
from tests.tiny_model import tiny_tokenizer, write_tiny_gguf
from tokenmill.config import Config, ConfigError
from tokenmill.engine.core import EngineCore
from tokenmill.engine.guided import Guide, json_schema_guide
from tokenmill.engine.outputs import RequestOutput, StepReport
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import MAX_GUIDED_ROWS
from tokenmill.engine.speculation import (
    EXPLORE_EVERY,
    MAX_FIXED_ROWS,
    DraftState,
    SpeculativeConfig,
    StepCost,
    plan,
    propose,
)
from tokenmill.kernels import ops
from tokenmill.server.load import load_engine_core

REPEATED = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
EOS_BANNED = {TOK.eos_id: -100.0}

REQUESTS: dict[str, tuple[str, SamplingParams]] = {
    "plain": (REPEATED, SamplingParams(max_tokens=48, temperature=0.0, logit_bias=EOS_BANNED)),
    "logprobs": (REPEATED, SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, logit_bias=EOS_BANNED)),
    "stopped": ("abcabcabcabcabc", SamplingParams(max_tokens=40, temperature=0.0, stop=["ca"], logit_bias=EOS_BANNED)),
    "penalised": (
        "xyzxyzxyzxyzxyz",
        SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.2),
    ),
    "min_tokens": ("1 2 3 1 2 3 1 2 3 1 2", SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20)),
    "biased": ("hello hello hello hello", SamplingParams(max_tokens=30, temperature=0.0, logit_bias={50: 2.0})),
    "two": (REPEATED, SamplingParams(max_tokens=30, temperature=0.0, n=2, logit_bias=EOS_BANNED)),
    "short": ("aaaaaaaaaaaa", SamplingParams(max_tokens=3, temperature=0.0, logit_bias=EOS_BANNED)),
    "sampled": (REPEATED, SamplingParams(max_tokens=30, temperature=0.9, seed=3)),
    "peaked": (REPEATED, SamplingParams(max_tokens=40, temperature=0.3, top_k=20, seed=11, logit_bias=EOS_BANNED)),
}


def choices(outs: list[RequestOutput]) -> dict[int, dict[str, Any]]:
    """Each choice's whole output, however the steps cut it into deltas."""
    found: dict[int, dict[str, Any]] = {}
    for out in outs:
        assert out.error is None, out.error
        for d in out.deltas:
            c = found.setdefault(d.index, {"ids": [], "text": "", "logprobs": [], "finish": None})
            c["ids"] += d.token_ids
            c["text"] += d.text
            c["logprobs"] += d.logprobs or []
            if d.finish_reason is not None:
                c["finish"] = (d.finish_reason, d.stop_reason, d.cumulative_logprob, d.num_tokens)
    return found


def run(core: EngineCore, names: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
    for name in names:
        prompt, params = REQUESTS[name]
        core.add_request(name, TOK.encode(prompt), params)
    return {name: choices(outs) for name, outs in run_all(core).items()}


@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_greedy_outputs_are_the_same_with_and_without_drafts(together: bool) -> None:
    groups = [list(REQUESTS)] if together else [[name] for name in REQUESTS]
    plain, drafted = {}, {}
    core = drafting_core(speculative="ngram", num_speculative_tokens=5)
    for names in groups:
        plain.update(run(tiny_core(), names))
        drafted.update(run(core, names))
    assert drafted == plain
    st = core.snapshot_stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens  # drafts were made and kept
    assert sum(st.spec_accepted_per_position) == st.spec_accepted_tokens


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_greedy_outputs_are_the_same_on_the_c_path_with_its_greedy_head(tmp_path: Path) -> None:
    """A Q8_0 head: a lone row's step runs in one C call with the head's quick pass; a drafted step does not."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", quantize=True)

    def core(**extra: object) -> EngineCore:
        return load_engine_core(Config(model=str(path), cache_dir=str(tmp_path / "cache"), **extra)).core  # type: ignore[arg-type]

    names = ["plain", "logprobs", "penalised", "two"]
    drafting = core(speculative="ngram")
    drafting.step_cost = FixedCost(MAX_FIXED_ROWS)
    for name in names:
        assert run(drafting, [name]) == run(core(), [name])
    assert run(drafting, names) == run(core(), names)
    assert drafting.snapshot_stats().spec_accepted_tokens > 0


def test_each_finished_choice_s_drafts_are_in_the_stats() -> None:
    core = drafting_core(speculative="ngram")
    run(core, ["plain", "two", "short"])
    st = core.snapshot_stats()
    listed = {(r["request_id"], r["index"]): r for r in st.spec_responses}
    assert set(listed) == {("plain", 0), ("two", 0), ("two", 1), ("short", 0)}
    assert sum(r["draft_tokens"] for r in listed.values()) == st.spec_draft_tokens
    assert sum(r["accepted_tokens"] for r in listed.values()) == st.spec_accepted_tokens
    plain = listed[("plain", 0)]
    assert plain["completion_tokens"] == 48 and plain["drafts"] > 0
    assert plain["acceptance"] == plain["accepted_tokens"] / plain["draft_tokens"]
    assert tiny_core().snapshot_stats().spec_responses == []  # speculation off: nothing to list


GRAMMARS = {
    "regex": Guide("regex", r"The quick brown fox jumps over the lazy dog\. (yes|no)\. The quick brown fox\."),
    "json": json_schema_guide(
        {
            "type": "object",
            "properties": {"first_name_of_the_person": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
            "required": ["first_name_of_the_person", "age"],
        }
    ),
}


def guided_run(core: EngineCore, names: list[str], max_tokens: int = 80) -> dict[str, dict[int, dict[str, Any]]]:
    tok = tiny_tokenizer()
    for name in names:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guide=GRAMMARS[name.split("-")[0]])
        core.add_request(name, tok.encode("hello world"), params)
    return {name: choices(outs) for name, outs in run_all(core).items()}


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_a_grammar_s_forced_text_is_drafted_and_changes_nothing(grammar: str) -> None:
    """The text a grammar allows alone (a regex's literal, a schema's keys) is a draft; each kept token was still
    sampled under its mask, so the output is the one without drafts, in fewer steps."""
    plain, drafting = gemma_vocab_core(), gemma_vocab_core(speculative="ngram")
    drafting.step_cost = FixedCost(MAX_FIXED_ROWS)
    assert guided_run(drafting, [grammar]) == guided_run(plain, [grammar])
    st = drafting.snapshot_stats()
    assert st.spec_accepted_tokens > 0 and st.steps < plain.snapshot_stats().steps


def test_drafts_under_grammars_stay_within_a_step_s_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"regex-{i}" for i in range(6)]
    expected = guided_run(gemma_vocab_core(), names, max_tokens=30)
    core = gemma_vocab_core(speculative="ngram")
    core.step_cost = FixedCost(MAX_FIXED_ROWS)
    masks_in_step = masks_per_step(monkeypatch, core)
    assert guided_run(core, names, max_tokens=30) == expected
    assert core.snapshot_stats().spec_accepted_tokens > 0
    assert max(masks_in_step) <= MAX_GUIDED_ROWS


def test_a_seeded_sampled_request_is_drafted_and_draws_the_same_tokens() -> None:
    """Each token takes one draw from the sequence's generator, in order, with a draft as without."""
    core = drafting_core(speculative="ngram")
    for name in ("peaked", "sampled"):
        assert run(core, [name]) == run(tiny_core(), [name]), name
    st = core.snapshot_stats()
    assert st.spec_drafts > 0 and st.spec_accepted_tokens > 0


def test_sampled_rows_draft_only_alone() -> None:
    """Sampling a row costs more than its share of the pass: beside another row, a sampled row gets no draft."""
    prompt, params = REQUESTS["peaked"]
    alone, together = drafting_core(speculative="ngram"), drafting_core(speculative="ngram")
    alone.add_request("a", TOK.encode(prompt), params)
    for name in ("a", "b"):  # the same prompt and length: prefilled and decoded side by side to the end
        together.add_request(name, TOK.encode(prompt), params)
    run_all(alone)
    run_all(together)
    assert alone.snapshot_stats().spec_drafts > 0
    assert together.snapshot_stats().spec_drafts == 0


@pytest.mark.parametrize(("fixed_rows", "drafted"), [(100.0, True), (0.1, False)], ids=["rows cheap", "rows dear"])
def test_drafts_are_made_where_the_step_cost_says_they_pay(fixed_rows: float, drafted: bool) -> None:
    """The same prompt for every request, all prefilled in one step: eight decode side by side to the end. With a
    step's fixed part worth 100 rows a draft token pays at any rate; worth a tenth of a row, none does, but for one
    token in one step of every EXPLORE_EVERY, which keeps the step cost measured."""
    core = tiny_core(speculative="ngram", max_num_prefills=8, max_num_batched_tokens=512)
    core.step_cost = FixedCost(fixed_rows)
    for i in range(8):
        params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=EOS_BANNED)
        core.add_request(f"r{i}", TOK.encode(REPEATED), params)
    run_all(core)
    st = core.snapshot_stats()
    if drafted:
        assert st.spec_draft_tokens > st.spec_drafts > st.steps // EXPLORE_EVERY + 1
    else:
        assert 0 < st.spec_draft_tokens == st.spec_drafts <= st.steps // EXPLORE_EVERY + 1


def test_no_drafts_in_steps_of_more_rows_than_the_ceiling() -> None:
    """Nine decode rows side by side, one over max_rows: their steps have no drafts, however cheap rows look."""
    core = drafting_core(speculative="ngram", max_num_prefills=9, max_num_batched_tokens=2048)
    assert core.speculative.max_rows == 8
    steps: list[StepReport] = []
    core.step_observers.append(steps.append)
    for i in range(9):
        params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=EOS_BANNED)
        core.add_request(f"r{i}", TOK.encode(REPEATED), params)
    run_all(core)
    decoding = [step for step in steps if step.num_seqs == 9 and step.num_tokens < 2 * 9]  # not the prefill
    assert len(decoding) > 30 and all(step.num_tokens == 9 for step in decoding)
    assert core.snapshot_stats().spec_drafts > 0  # in the last steps, where fewer rows were left


def test_plan_checks_the_tokens_likely_enough_to_pay_for_their_rows() -> None:
    # one row, fixed part 4 rows: 0.9 > 1.15 × 1/5, 0.81 > 1.15 × 1.9/6, 0.729 > 1.15 × 2.71/7, 0.656 > 1.15 × 3.44/8
    assert plan([0.9], [4], 4.0, budget=16) == [4]
    assert plan([0.9], [4], 4.0, budget=2) == [2]
    assert plan([0.9], [2], 4.0, budget=16) == [2]
    assert plan([0.3], [4], 4.0, budget=16) == [1]  # 0.3 > 1.15 × 1/5, then 0.09 < 1.15 × 1.3/6
    assert plan([0.2], [4], 4.0, budget=16) == [0]  # 0.2 does not beat 1/5 by the margin
    # sixteen rows of a model whose rows dominate: only near-certain drafts, likeliest first (the rows beside them
    # would lose, which the next test is about)
    unbounded = math.inf
    # 0.95 > 1.15 × 16/20, then 0.9025 < 1.15 × 16.95/21
    assert plan([0.95] + [0.5] * 15, [4] * 16, 4.0, 16, max_slowdown=unbounded) == [1] + [0] * 15
    assert plan([0.99] + [0.5] * 15, [4] * 16, 4.0, 16, max_slowdown=unbounded) == [4] + [0] * 15
    assert plan([0.9, 0.99], [0, 4], 100.0, 16, max_slowdown=unbounded) == [0, 4]


def test_plan_slows_a_row_without_a_draft_by_at_most_the_bound() -> None:
    # four rows, a fixed part of 16 rows: the undrafted step is 20 rows' worth of time. Three rows draft near-surely,
    # one has no draft: drafts stop where the step would take more than 1.2 × 20 = 24 rows, so 4 tokens, not 16
    taken = plan([0.99, 0.99, 0.99, 0.0], [16, 16, 16, 0], 16.0, budget=16, max_slowdown=1.2)
    assert sum(taken) == 4 and taken[3] == 0
    assert sum(plan([0.99, 0.99, 0.99, 0.0], [16, 16, 16, 0], 16.0, budget=16, max_slowdown=100.0)) == 16
    # ... unless the row without a draft now has made two tokens a step lately from its drafts: it can wait a step
    assert sum(plan([0.99, 0.99, 0.99, 0.0], [16, 16, 16, 0], 16.0, 16, [0.0, 0.0, 0.0, 2.0], max_slowdown=1.2)) == 16
    # every row drafting: each row's own expected tokens pay for the longer step, and the bound gives way
    assert sum(plan([0.99] * 4, [16] * 4, 16.0, budget=16, max_slowdown=1.0)) == 16

    # where the steps' times are known they decide, not the fixed part: here a 4-row step takes 10 ms and each row
    # past it 1 ms, so 1.2 × allows 2 rows, where the fixed part of 16 rows would have allowed 4
    def seconds_at(rows: int) -> float:
        return 0.010 + 0.001 * (rows - 4)

    taken = plan([0.99, 0.99, 0.99, 0.0], [16, 16, 16, 0], 16.0, 16, None, seconds_at, max_slowdown=1.2)
    assert sum(taken) == 2
    # one row alone is never held back by it: its draft is what the longer step buys
    assert plan([0.9], [4], 4.0, budget=16, max_slowdown=1.0) == [4]


def test_step_cost_gives_a_step_s_time_where_it_saw_it_or_between() -> None:
    cost = StepCost(prior_rows=4.0)
    assert cost.seconds_at(4) is None
    cost.observe(4, 0.010)
    cost.observe(8, 0.014)
    assert cost.seconds_at(4) == 0.010 and cost.seconds_at(8) == 0.014
    assert cost.seconds_at(6) == pytest.approx(0.012)  # between the two seen
    assert cost.seconds_at(2) is None and cost.seconds_at(9) is None  # beyond them: not known


def test_step_cost_fits_the_fixed_part_near_the_step_s_rows() -> None:
    cost = StepCost(prior_rows=4.0)
    assert cost.fixed_rows(1) == cost.fixed_rows(4) == 4.0  # nothing seen: small steps take the prior
    assert cost.fixed_rows(16) == 0.0  # ... and larger ones no fixed part: no drafts until something says they pay
    for _ in range(20):
        cost.observe(16, 0.037)
    assert cost.fixed_rows(16) == 0.0  # one row count seen: nothing to fit a line through
    # flat while the weights' reading bounds the step, then 2 ms a row from 8 rows on
    for _ in range(3):
        for rows in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24):
            cost.observe(rows, max(0.010, 0.002 * rows))
    assert cost.fixed_rows(2) == MAX_FIXED_ROWS  # 1 to 4 rows cost the same
    assert cost.fixed_rows(16) < 1.0  # 8 to 32 rows: nearly all per row
    assert 1.0 < cost.fixed_rows(6) < MAX_FIXED_ROWS


def test_a_sequence_s_credit_is_what_its_drafts_kept_a_step_lately() -> None:
    state = DraftState()
    assert state.credit == 0.0
    for _ in range(30):
        state.step()
        state.settle(4, 3)
    assert state.credit == pytest.approx(3.0, rel=0.01)  # three tokens kept every step
    for _ in range(30):
        state.step()  # steps without a draft
    assert state.credit < 0.01


def test_a_sequence_s_rate_of_kept_tokens_follows_its_drafts() -> None:
    state = DraftState()
    assert state.rate == 0.75 and DraftState.starting(0.9).rate == 0.9 and DraftState.starting(0.2).rate == 0.75
    for _ in range(10):
        state.settle(4, 4)
    high = state.rate
    assert high > 0.9
    state.settle(4, 0)
    assert state.rate < high


def test_lookup_takes_what_followed_the_longest_most_recent_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3]
    assert propose(tokens, DraftState(), 3, 2, 4) == [4, 5, 6]  # "2 3" last seen before the end at 6..7
    assert propose([5, 6, 7, 8, 1, 2], DraftState(), 3, 2, 4) == []  # no earlier "1 2"
    assert propose(tokens, DraftState(), 0, 2, 4) == []
    longest = [7, 1, 2, 8, 0, 1, 2, 9, 7, 1, 2]  # "1 2" last before "9"; "7 1 2" before "8"
    assert propose(longest, DraftState(), 2, 2, 4) == [8, 0]


def test_lookup_index_grows_with_the_sequence() -> None:
    state = DraftState()
    tokens = [1, 2, 3, 1, 2]
    assert propose(tokens, state, 2, 2, 4) == [3, 1]
    tokens += [3, 4, 1, 2, 3]
    assert propose(tokens, state, 2, 2, 4) == [4, 1]
    assert state.indexed == len(tokens)


def test_misses_in_a_row_pause_drafting_longer() -> None:
    state = DraftState()
    pauses = []
    for _ in range(8):
        state.settle(4, 0)
        pauses.append(state.pause)
    assert pauses == [1, 2, 4, 8, 16, 32, 32, 32]
    state.settle(4, 2)
    assert state.misses == 0


def test_the_flags_check_the_draft_length() -> None:
    with pytest.raises(ConfigError):
        Config(speculative="ngram", num_speculative_tokens=0)


def test_vllms_speculative_config_sets_the_lookup() -> None:
    given = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5, "prompt_lookup_min": 3}'
    core = tiny_core(speculative_config=given)
    assert core.speculative == SpeculativeConfig("ngram", num_tokens=6, min_ngram=3, max_ngram=5)
    assert tiny_core(speculative="ngram").speculative == SpeculativeConfig("ngram", 16, 2, 4)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ('{"method": "eagle"}', "eagle"),
        ('{"method": "ngram", "model": "draft.gguf"}', "model"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "suffix", "suffix_store_tokens": -1}', "suffix_store_tokens"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob"),
        ('{"method": "suffix", "suffix_corpus": "/no/such/file"}', "suffix_corpus"),
        ('{"method": "suffix", "suffix_decoding_max_cached_requests": 10}', "suffix_decoding_max_cached_requests"),
        ('["ngram"]', "JSON object"),
        ("{ngram", "not JSON"),
    ],
)
def test_a_speculative_config_it_cannot_honour_is_refused_by_name(given: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config(speculative_config=given)


# a prompt that does not repeat itself, so that a sequence's own lookup has little to draft from
FRESH = "the quick brown fox jumps over the lazy dog"
ASKED = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=EOS_BANNED)


def ask(core: EngineCore, name: str, prompt: str, tenant: str = "anonymous") -> dict[int, dict[str, Any]]:
    params = dataclasses.replace(ASKED, tenant=tenant)
    core.add_request(name, TOK.encode(prompt), params)
    return choices(run_all(core)[name])


def kept(core: EngineCore) -> int:
    return core.snapshot_stats().spec_accepted_tokens


def test_the_suffix_store_drafts_a_repeated_request_from_the_first_and_changes_nothing() -> None:
    plain, own, shared = tiny_core(), drafting_core(speculative="ngram"), drafting_core(speculative="suffix")
    first = ask(plain, "a", FRESH)
    assert ask(own, "a", FRESH) == ask(shared, "a", FRESH) == first
    assert shared.snapshot_stats().spec_store_drafts == 0  # nothing in the store yet
    assert ask(own, "b", FRESH) == ask(shared, "b", FRESH) == first
    st = shared.snapshot_stats()
    assert st.spec_store_drafts > 0 and own.snapshot_stats().spec_store_drafts == 0
    assert st.spec_store_tokens == len(TOK.encode(FRESH)) + 40  # identical documents are kept once
    assert st.spec_store_bytes > 0 and own.snapshot_stats().spec_store_bytes == 0


def stored(core: EngineCore) -> int:
    return core.snapshot_stats().spec_store_drafts


def test_the_suffix_store_keeps_each_tenant_s_text_from_the_others() -> None:
    core = drafting_core(speculative="suffix")
    ask(core, "a", FRESH, tenant="key-one")
    ask(core, "b", FRESH, tenant="key-two")
    assert stored(core) == 0
    ask(core, "c", FRESH, tenant="key-one")
    assert stored(core) > 0


def test_the_suffix_store_stays_within_its_tokens() -> None:
    core = drafting_core(speculative_config='{"method": "suffix", "suffix_store_tokens": 60}')
    for i in range(4):
        ask(core, f"r{i}", f"{i} {FRESH}")
    assert 0 < core.snapshot_stats().spec_store_tokens <= 60


def test_a_corpus_file_drafts_for_every_tenant(tmp_path: Path) -> None:
    plain = tiny_core()
    answer = ask(plain, "a", FRESH)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(FRESH + answer[0]["text"])
    given = json.dumps({"method": "suffix", "suffix_corpus": str(corpus)})
    with_corpus, without = drafting_core(speculative_config=given), drafting_core(speculative="suffix")
    assert ask(with_corpus, "a", FRESH, tenant="anyone") == ask(without, "a", FRESH, tenant="anyone") == answer
    assert stored(with_corpus) > 0 and stored(without) == 0
