"""EngineCore on a tiny random model: paged, batched, chunked and forked runs agree with a plain dense forward."""

from __future__ import annotations

import torch

from tests.engine.tiny import TOK, choice_tokens, greedy, run_all, tiny_core
from tokenmill.engine.core import EngineCore
from tokenmill.engine.outputs import FinishReason, RequestOutput
from tokenmill.engine.sampling import SamplingParams


def choice_text(outs: list[RequestOutput], index: int = 0) -> str:
    return "".join(d.text for o in outs for d in o.deltas if d.index == index)


def dense_greedy(core: EngineCore, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        logits = core.runner.model.forward_dense(torch.tensor(ids))
        ids.append(int(torch.argmax(logits[-1])))
    return ids[len(prompt) :]


def test_greedy_matches_dense_forward() -> None:
    core = tiny_core()
    prompt = TOK.encode("hello paged world")
    core.add_request("a", prompt, greedy(12))
    outs = run_all(core)["a"]
    assert choice_tokens(outs) == dense_greedy(core, prompt, 12)
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason is FinishReason.LENGTH


def test_batched_and_chunked_runs_equal_single_runs() -> None:
    prompts = [TOK.encode(t) for t in ("a", "the quick brown fox jumps over the lazy dog " * 3, "xyz", "hello")]
    single = []
    for i, p in enumerate(prompts):
        core = tiny_core()
        core.add_request(str(i), p, greedy(10))
        single.append(choice_tokens(run_all(core)[str(i)]))
    core = tiny_core(max_num_batched_tokens=16)  # forces chunked prefill next to decodes
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, greedy(10))
    batched = run_all(core)
    assert [choice_tokens(batched[str(i)]) for i in range(len(prompts))] == single
    assert core.stats.steps_with_multiple_seqs > 0
    assert core.blocks.num_used == 0


def test_request_joins_mid_flight() -> None:
    core = tiny_core()
    core.add_request("first", TOK.encode("one"), greedy(20))
    for _ in range(3):
        core.step()
    core.add_request("second", TOK.encode("two"), greedy(5))
    core.step()
    assert {s.request_id for s in core.scheduler.running} == {"first", "second"}
    run_all(core)
    assert core.stats.max_seqs_in_step == 2


def test_prefix_cache_reuses_blocks_and_reports_cached_tokens() -> None:
    core = tiny_core()
    prompt = TOK.encode("a shared prefix of some length, then more")
    core.add_request("a", prompt, greedy(4))
    first = run_all(core)["a"]
    core.add_request("b", prompt, greedy(4))
    second = run_all(core)["b"]
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert choice_tokens(first) == choice_tokens(second)


def test_n_forks_share_the_prompt_and_seeds_differ_per_choice() -> None:
    core = tiny_core()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, logit_bias={TOK.eos_id: -100.0})
    core.add_request("r", TOK.encode("fork me"), params)
    outs = run_all(core)["r"]
    choices = [choice_tokens(outs, j) for j in range(3)]
    assert all(len(c) == 8 for c in choices)
    assert len({tuple(c) for c in choices}) > 1
    assert core.stats.tokens_computed == len(TOK.encode("fork me")) + 3 * 7  # prompt prefilled once
    again = tiny_core()
    again.add_request("r", TOK.encode("fork me"), params)
    again_outs = run_all(again)["r"]
    assert [choice_tokens(again_outs, j) for j in range(3)] == choices
    assert core.blocks.num_used == 0


def test_prompt_logprobs_equal_dense_log_softmax() -> None:
    core = tiny_core(max_num_batched_tokens=8)  # scored across several chunks
    prompt = TOK.encode("score this prompt please")
    core.add_request("s", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=0.0))
    outs = run_all(core)["s"]
    entries = outs[0].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0].logprob is None
    ref = torch.log_softmax(core.runner.model.forward_dense(torch.tensor(prompt)), dim=-1)
    for pos in range(1, len(prompt)):
        assert abs(entries[pos].logprob - float(ref[pos - 1, prompt[pos]])) < 1e-4
        assert entries[pos].top[0][0] == int(torch.argmax(ref[pos - 1]))
    assert choice_tokens(outs) == [] and outs[-1].deltas[0].finish_reason is FinishReason.LENGTH


def test_stop_string_is_cut_and_finishes() -> None:
    core = tiny_core()
    prompt = TOK.encode("abc")
    ref_text = TOK.decode(dense_greedy(core, prompt, 12))
    stop = ref_text[3:5]
    core.add_request("s", prompt, greedy(12, stop=(stop,)))
    outs = run_all(core)["s"]
    text = choice_text(outs)
    assert text == ref_text[: ref_text.index(stop)]
    assert outs[-1].deltas[-1].finish_reason is FinishReason.STOP


def test_preemption_under_tiny_cache_gives_the_same_text() -> None:
    prompts = [TOK.encode(f"prompt number {i}") for i in range(4)]
    roomy = tiny_core()
    for i, p in enumerate(prompts):
        roomy.add_request(str(i), p, greedy(24))
    expected = run_all(roomy)
    tight = tiny_core(num_kv_blocks=20)
    for i, p in enumerate(prompts):
        tight.add_request(str(i), p, greedy(24))
    got = run_all(tight)
    assert tight.scheduler.num_preemptions > 0
    for i in range(4):
        assert choice_tokens(got[str(i)]) == choice_tokens(expected[str(i)])
    assert tight.blocks.num_used == 0


def test_abort_frees_blocks() -> None:
    core = tiny_core()
    core.add_request("x", TOK.encode("to be cancelled"), greedy(50))
    for _ in range(3):
        core.step()
    assert core.blocks.num_used > 0
    core.abort("x")
    assert core.blocks.num_used == 0 and not core.has_work


def test_logprobs_entries_match_generated_tokens() -> None:
    core = tiny_core()
    core.add_request("l", TOK.encode("hi"), greedy(5, logprobs=3))
    outs = run_all(core)["l"]
    entries = [e for o in outs for d in o.deltas for e in (d.logprobs or [])]
    assert [e.token_id for e in entries] == choice_tokens(outs)
    for e in entries:
        assert len(e.top) == 3 and e.top[0][0] == e.token_id  # greedy: the chosen token is the most likely
        assert e.logprob is not None and abs(e.logprob - e.top[0][2]) < 1e-6


def test_a_sequence_computes_the_same_numbers_alone_and_under_load() -> None:
    """Batch invariance: padding-free attention and row-invariant matmuls make load invisible, bit for bit."""
    target = TOK.encode("the same request")
    params = greedy(12, logprobs=2)
    alone = tiny_core()
    alone.add_request("t", target, params)
    expected = run_all(alone)["t"]
    loaded = tiny_core(max_num_batched_tokens=24)
    for i in range(6):
        loaded.add_request(f"o{i}", TOK.encode("other " * (i + 1)), greedy(6 + 3 * i))
    loaded.step()
    loaded.add_request("t", target, params)
    got = run_all(loaded)["t"]
    lp = [(e.token_id, e.logprob) for o in got for d in o.deltas for e in d.logprobs or []]
    assert lp == [(e.token_id, e.logprob) for o in expected for d in o.deltas for e in d.logprobs or []]


def test_a_burst_is_prefilled_a_few_prompts_a_step_while_the_first_ones_decode() -> None:
    prompts = [TOK.encode(f"prompt number {i}") for i in range(10)]
    capped, uncapped = (tiny_core(max_num_prefills=cap, max_num_batched_tokens=256) for cap in (4, 64))
    for core in (capped, uncapped):
        for i, p in enumerate(prompts):
            core.add_request(str(i), p, greedy(6))
    outputs: dict[str, list[RequestOutput]] = {}
    have_a_token = []  # after each of the capped core's first three steps: requests with a token so far
    for _ in range(3):
        for out in capped.step():
            outputs.setdefault(out.request_id, []).append(out)
        have_a_token.append(sum(1 for outs in outputs.values() if choice_tokens(outs)))
    assert have_a_token == [4, 8, 10]  # 4 new prompts a step, the earlier ones decoding beside them
    for request_id, outs in run_all(capped).items():
        outputs.setdefault(request_id, []).extend(outs)
    everything: dict[str, list[RequestOutput]] = {}
    for out in uncapped.step():
        everything.setdefault(out.request_id, []).append(out)
    assert len(uncapped.scheduler.running) == 10 and not uncapped.scheduler.waiting  # the whole burst in one step
    for request_id, outs in run_all(uncapped).items():
        everything.setdefault(request_id, []).extend(outs)
    # when a prompt is prefilled does not change what it generates
    assert {i: choice_tokens(outputs[str(i)]) for i in range(10)} == {
        i: choice_tokens(everything[str(i)]) for i in range(10)
    }
    assert capped.blocks.num_used == 0


def test_the_prefill_backlog_is_the_prompt_tokens_not_yet_computed() -> None:
    core = tiny_core(max_num_prefills=1, max_num_batched_tokens=8)
    long, short = TOK.encode("a long prompt of many bytes"), TOK.encode("hi")
    core.add_request("long", long, greedy(3))
    core.add_request("short", short, greedy(3))
    assert core.prefill_backlog() == len(long) + len(short)
    core.step()  # 8 of the long prompt's tokens
    assert core.prefill_backlog() == len(long) - 8 + len(short)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    assert core.prefill_backlog() == 0  # both decoding: nothing of theirs left to prefill
    run_all(core)
    core.add_request("again", long + short, greedy(3))  # waiting, the long prompt's whole blocks of 4 cached
    assert core.prefill_backlog() == len(long) + len(short) - len(long) // 4 * 4 < len(long)
    run_all(core)


def test_a_prompt_still_in_chunked_prefill_counts_against_the_cap() -> None:
    core = tiny_core(max_num_prefills=1, max_num_batched_tokens=8)
    core.add_request("long", TOK.encode("a long prompt of many bytes"), greedy(3))  # 27 tokens: four chunks
    core.add_request("short", TOK.encode("hi"), greedy(3))
    for _ in range(3):
        core.step()
        assert [s.request_id for s in core.scheduler.running] == ["long"]  # "short" waits, budget or not
    core.step()  # the long prompt's last chunk: still one prefill in the step
    assert [s.request_id for s in core.scheduler.running] == ["long"]
    core.step()
    assert [s.request_id for s in core.scheduler.running] == ["long", "short"]
    run_all(core)
