from __future__ import annotations

import math

import torch

from tokenmill.engine.sampler import SampleInput, _greedy_by_head, sample
from tokenmill.engine.sampling import SamplingParams


def row(seed: int | None = None, counts: dict[int, int] | None = None, **kw: object) -> SampleInput:
    gen = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator().manual_seed(0)
    return SampleInput(SamplingParams(**kw), gen, counts or {})  # type: ignore[arg-type]


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])


def test_greedy_takes_argmax_and_reports_raw_logprob() -> None:
    (r,) = sample(LOGITS, [row(temperature=0.0, logprobs=2)])
    assert r.token_id == 0
    assert math.isclose(r.logprob, float(torch.log_softmax(LOGITS[0], -1)[0]), rel_tol=1e-6)
    assert [t for t, _ in r.top] == [0, 1]


def test_a_temperature_too_small_to_divide_by_samples_greedily() -> None:
    (r,) = sample(LOGITS, [row(temperature=1e-40, seed=3, logprobs=1)])
    (greedy,) = sample(LOGITS, [row(temperature=0.0, logprobs=1)])
    assert r.token_id == greedy.token_id == 0 and math.isfinite(r.logprob) and r.logprob == greedy.logprob


def test_logit_bias_bans_and_forces() -> None:
    (banned,) = sample(LOGITS, [row(temperature=0.0, logit_bias={0: -100.0})])
    assert banned.token_id == 1
    logits = LOGITS.clone()
    (forced,) = sample(logits, [row(temperature=1.0, logit_bias={3: 100.0}, seed=1, logprobs=0)])
    assert forced.token_id == 3
    assert forced.logprob < -2.0  # still the model's own logprob, before the bias
    assert torch.equal(logits, LOGITS)  # the bias was applied in place and undone exactly


def test_the_chosen_logprob_is_computed_only_when_used() -> None:
    (plain,) = sample(LOGITS, [row(temperature=0.0)])
    assert plain.logprob is None and plain.top == []
    (ranked,) = sample(LOGITS, [row(temperature=0.0, n=2)])  # best_of / n rank choices by it
    assert ranked.logprob is not None and math.isclose(
        ranked.logprob, float(torch.log_softmax(LOGITS[0], -1)[0]), rel_tol=1e-6
    )


def test_penalties_follow_openai_formula() -> None:
    counts = {0: 2}
    (r,) = sample(LOGITS, [row(temperature=0.0, counts=counts, frequency_penalty=0.6, presence_penalty=0.0)])
    assert r.token_id == 1  # 2.0 - 2 * 0.6 = 0.8 < 1.0
    (r,) = sample(LOGITS, [row(temperature=0.0, counts=counts, frequency_penalty=0.4)])
    assert r.token_id == 0  # 2.0 - 0.8 = 1.2 > 1.0
    logits = LOGITS.clone()
    (r,) = sample(logits, [row(temperature=0.0, counts=counts, presence_penalty=1.5, logit_bias={0: 0.25})])
    assert r.token_id == 1  # 2.0 + 0.25 - 1.5 = 0.75 < 1.0
    assert torch.equal(logits, LOGITS)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([[5.0, 4.0, -5.0, -5.0, -5.0]])
    seen = {sample(logits, [row(seed=s, temperature=1.0, top_p=0.5)])[0].token_id for s in range(30)}
    assert seen == {0}
    seen = {sample(logits, [row(seed=s, temperature=1.0, top_p=0.99)])[0].token_id for s in range(60)}
    assert seen == {0, 1}


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    """Each row draws from its own generator: its tokens are the same alone, in a batch and in another order.

    Over a few thousand random logits at temperature 1 two different draws almost never pick the same token, so rows
    sharing one generator, or a batch that shifts a row's draw, change nearly every token after the first row's.
    """
    seeds, vocab, steps = [3, 17, 42, 1234, 99991], 4096, 4
    logits = torch.randn(steps, len(seeds), vocab, generator=torch.Generator().manual_seed(0)) * 2  # (S, R, V)

    def run(order: list[int]) -> dict[int, list[int]]:
        """Each row's tokens over the steps, sampled as one batch of the rows in `order`."""
        rows = {i: row(seed=seeds[i], temperature=1.0) for i in order}
        tokens: dict[int, list[int]] = {i: [] for i in order}
        for step in range(steps):
            for i, result in zip(order, sample(logits[step, order], [rows[i] for i in order])):
                tokens[i].append(result.token_id)
        return tokens

    alone = {i: run([i])[i] for i in range(len(seeds))}
    assert len({tuple(t) for t in alone.values()}) == len(seeds)  # the seeds differ, and so do their draws
    assert run(list(range(len(seeds)))) == alone
    assert run(list(reversed(range(len(seeds))))) == alone


def test_top_p_wider_than_the_candidate_shortlist_still_covers_the_nucleus() -> None:
    flat = torch.zeros(1, 5000)  # uniform: the 0.9 nucleus holds 4500 tokens, far more than the shortlist
    seen = {sample(flat, [row(seed=s, temperature=1.0, top_p=0.9)])[0].token_id for s in range(200)}
    assert max(seen) > 1024


def test_adjusted_applies_each_rows_bias_and_penalties_to_its_own_row_and_undoes_them_exactly() -> None:
    from tokenmill.engine.sampler import adjusted

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen)
    original = logits.clone()
    rows = [
        row(logit_bias={1: 2.5, 7: -100.0}, counts={7: 3, 9: 1}, frequency_penalty=0.3, presence_penalty=0.7),
        row(),  # untouched
        row(logit_bias={7: 1.0}, counts={2: 4}, frequency_penalty=-0.2),
    ]
    expected = original.clone()
    for i, r in enumerate(rows):  # the formula, one row and one entry at a time
        for token, b in r.params.logit_bias.items():
            expected[i, token] += torch.tensor(b)
        if r.params.has_penalties:
            for token, count in r.output_counts.items():
                f, p = torch.tensor(r.params.frequency_penalty), torch.tensor(r.params.presence_penalty)
                expected[i, token] -= torch.tensor(float(count)) * f + p
    with adjusted(logits, rows) as processed:
        assert processed is logits and torch.equal(processed, expected)
    assert torch.equal(logits, original)


# --- the knobs beyond the reference -------------------------------------------------------------------------------
WIDE = torch.randn(3, 50, generator=torch.Generator().manual_seed(7)) * 3


def sampled_ids(logits: torch.Tensor, draws: int, **kw: object) -> set[int]:
    return {sample(logits.clone(), [row(seed=s, temperature=1.0, **kw)])[0].token_id for s in range(draws)}


def test_top_k_samples_only_among_the_k_likeliest() -> None:
    best = set(torch.topk(WIDE[0], 4).indices.tolist())
    got = sampled_ids(WIDE[:1], 200, top_k=4)
    assert got <= best and len(got) > 1
    assert len(sampled_ids(WIDE[:1], 200)) > 4  # without it, more than four tokens come up


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    probs = torch.softmax(WIDE[0], -1)
    kept = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = sampled_ids(WIDE[:1], 200, min_p=0.2)
    assert got <= kept and len(got) > 1


def test_top_k_then_top_p_take_the_nucleus_of_what_top_k_kept() -> None:
    got = sampled_ids(WIDE[:1], 200, top_k=5, top_p=0.5)
    probs = torch.softmax(WIDE[0], -1)
    values, ids = torch.topk(probs, 5)
    mass_before = torch.cumsum(values / values.sum(), 0) - values / values.sum()
    assert got <= set(ids[mass_before < 0.5].tolist())


def test_repetition_penalty_is_transformers_formula() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    seen = [3, 7, 7, 11, 20, 42]
    logits = WIDE.clone()
    rows = [row(repetition_penalty=1.7), row(), row(repetition_penalty=0.6)]
    rows[0].seen, rows[2].seen = set(seen), set(seen[:3])
    from tokenmill.engine.sampler import adjusted

    with adjusted(logits, rows) as processed:
        got = processed.clone()
    assert torch.equal(logits, WIDE)  # undone exactly
    want = WIDE.clone()
    want[0] = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), WIDE[:1].clone())[0]
    want[2] = RepetitionPenaltyLogitsProcessor(0.6)(torch.tensor([seen[:3]]), WIDE[2:].clone())[0]
    assert torch.equal(got, want)


def test_allowed_and_banned_tokens_are_masked_and_undone() -> None:
    logits = WIDE.clone()
    greedy_allowed = sample(logits, [row(temperature=0.0, allowed_token_ids=(5, 9, 30))])[0].token_id
    assert greedy_allowed == max((5, 9, 30), key=lambda t: float(WIDE[0, t]))
    assert sampled_ids(WIDE[:1], 100, allowed_token_ids=(5, 9, 30)) <= {5, 9, 30}
    best = int(WIDE[0].argmax())
    banned = SampleInput(SamplingParams(temperature=0.0), None, {}, banned=[best])
    assert sample(logits, [banned])[0].token_id == int(torch.topk(WIDE[0], 2).indices[1])
    assert torch.equal(logits, WIDE)


def test_a_row_with_nothing_left_to_sample_fails() -> None:
    from tokenmill.engine.sampler import NoTokenLeft

    nothing = SampleInput(SamplingParams(temperature=0.0, allowed_token_ids=(4,)), None, {}, banned=[4])
    try:
        sample(WIDE[:1].clone(), [nothing])
    except NoTokenLeft:
        return
    raise AssertionError("sampled a token although every one was excluded")


def test_knobs_leave_other_rows_of_the_batch_alone() -> None:
    """A free row gets the same token and logprob beside constrained rows as alone (the batch-invariance rule)."""
    free = row(seed=4, temperature=0.9, logprobs=2)
    alone = sample(WIDE[1:2].clone(), [free])[0]
    knobs = [row(top_k=2, seed=1), row(seed=4, temperature=0.9, logprobs=2), row(min_p=0.3, allowed_token_ids=(1, 2))]
    knobs[0].banned = [0, 1]
    knobs[2].mask = torch.arange(50) % 2 == 0  # a grammar's mask, as structured outputs give one
    beside = sample(WIDE.clone(), knobs)[1]
    assert (beside.token_id, beside.logprob, beside.top) == (alone.token_id, alone.logprob, alone.top)


def test_a_grammar_mask_keeps_only_its_tokens_and_is_undone() -> None:
    logits = WIDE.clone()
    mask = torch.zeros(50, dtype=torch.bool)
    mask[[4, 17, 33]] = True
    greedy = SampleInput(SamplingParams(temperature=0.0), None, {}, mask=mask)
    assert sample(logits, [greedy])[0].token_id == max((4, 17, 33), key=lambda t: float(WIDE[0, t]))
    draws = {
        sample(logits, [SampleInput(SamplingParams(), torch.Generator().manual_seed(s), {}, mask=mask)])[0].token_id
        for s in range(50)
    }
    assert draws <= {4, 17, 33} and torch.equal(logits, WIDE)


def hinted(logits: torch.Tensor, row_input: SampleInput) -> SampleInput:
    """The row as the engine builds it where the LM head's pass found the raw argmax."""
    row_input.argmax = int(logits.argmax())
    return row_input


def test_a_greedy_row_takes_the_heads_argmax_without_another_pass() -> None:
    """The head's answer is trusted as it is: a (deliberately wrong) hint is what an untouched row chooses."""
    logits = WIDE[:1].clone()
    untouched = SampleInput(SamplingParams(temperature=0.0), None, {}, argmax=7)
    assert sample(logits, [untouched])[0].token_id == 7
    allowed = SampleInput(SamplingParams(temperature=0.0, allowed_token_ids=(3, 4)), None, {}, argmax=7)
    assert sample(logits, [allowed])[0].token_id == max((3, 4), key=lambda t: float(WIDE[0, t]))  # no hint taken


def test_the_heads_argmax_with_sparse_adjustments_gives_the_full_passes_choice() -> None:
    """Bias, bans and penalties on a few ids: the choice from the raw argmax and those ids equals the argmax over the
    whole adjusted row, ties (the first index wins) and the raw argmax itself being touched included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 5, (1, 64), generator=g).float()  # many equal values
    top = int(logits.argmax())
    equal = [t for t in range(64) if float(logits[0, t]) == float(logits[0, top]) and t != top]
    below = [t for t in range(64) if float(logits[0, t]) < float(logits[0, top])]
    cases: list[dict[str, object]] = [
        {"logit_bias": {below[0]: 100.0}},  # a touched id rises above the raw best
        {"logit_bias": {below[0]: float(logits[0, top] - logits[0, below[0]])}},  # ... to equal it
        {"logit_bias": {top: -100.0}},  # the raw best itself is touched: the full pass
        {"logit_bias": {equal[0]: -1.0}},  # a tie of the raw best lowered
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 1.3},
        {},
    ]
    for kw in cases:
        for banned in ([], [below[1]], [top]):
            params = SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]
            counts = {below[0]: 2, top: 1, equal[-1]: 1}
            plain = SampleInput(params, None, counts, banned=banned, seen={top, *below[:3]})
            expected = sample(logits.clone(), [plain])[0].token_id
            hint = SampleInput(params, None, counts, banned=banned, seen={top, *below[:3]})
            assert sample(logits.clone(), [hinted(logits[0], hint)])[0].token_id == expected, (kw, banned)


def test_greedy_rows_touched_by_bias_and_bans_alone_choose_from_a_few_values_as_the_full_pass_does() -> None:
    """A batch of greedy rows whose raw argmax the head found, each touched only by logit_bias and bans: the choice
    comes from those few values, adjusted in float32 as the pipeline adjusts them (sums that round, a biased id landing
    exactly on the raw best), and equals the full pass's, row for row."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 300, generator=g) * 3
    rows: list[SampleInput] = []
    for i in range(4):
        top = int(logits[i].argmax())
        near = [int(t) for t in logits[i].argsort(descending=True)[1:4]]
        gap = float(logits[i, top]) - float(logits[i, near[0]])
        bias = {near[0]: gap + 0.1 * i, near[1]: gap * 0.999, near[2]: -100.0} if i % 2 else {near[0]: gap}
        rows.append(SampleInput(SamplingParams(temperature=0.0, logit_bias=bias), None, {}, banned=[near[2]] * (i > 1)))
    expected = [r.token_id for r in sample(logits.clone(), rows)]
    hinted_rows = [hinted(logits[i], r) for i, r in enumerate(rows)]
    assert _greedy_by_head(logits, hinted_rows) is not None  # the quick path answers this batch
    assert [r.token_id for r in sample(logits.clone(), hinted_rows)] == expected
    assert sample(logits.clone(), hinted_rows)[0].logprob is None


def test_the_few_values_are_adjusted_in_float32_not_in_pythons_double() -> None:
    """A bias of 0.5 ± 2⁻³⁰ is 0.5 in float32: the biased id ties the raw best (the lower id wins), where a sum in
    double would put it just above or just below."""
    logits = torch.zeros(2, 8)
    logits[0, 0], logits[0, 5] = 1.0, 0.5  # the biased id after the raw best: a tie keeps the raw best
    logits[1, 3], logits[1, 1] = 1.0, 0.5  # the biased id before it: a tie takes the biased id
    rows = [
        SampleInput(SamplingParams(temperature=0.0, logit_bias={5: 0.5 + 2**-30}), None, {}, argmax=0),
        SampleInput(SamplingParams(temperature=0.0, logit_bias={1: 0.5 - 2**-30}), None, {}, argmax=3),
    ]
    assert [r.token_id for r in sample(logits, rows)] == [0, 1]
    for r in rows:
        r.argmax = None  # the full pass over the adjusted rows agrees
    assert [r.token_id for r in sample(logits, rows)] == [0, 1]
