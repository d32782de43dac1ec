"""A fault that belongs to one request fails that request alone; the others finish as if nothing happened."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.engine.tiny import TOK, choice_tokens, greedy, poison_hidden, run_all, tiny_core
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampler import Sampled
from tokenmill.engine.scheduler import Scheduled
from tokenmill.engine.sequence import Sequence


def two_requests(core: EngineCore, bad_params: dict[str, object] | None = None) -> None:
    core.add_request("good", TOK.encode("a healthy prompt"), greedy(12, n=2))
    core.add_request("bad", TOK.encode("a doomed prompt"), greedy(12, **(bad_params or {})))


def reference_tokens() -> list[list[int]]:
    core = tiny_core()
    core.add_request("good", TOK.encode("a healthy prompt"), greedy(12, n=2))
    outs = run_all(core)["good"]
    return [choice_tokens(outs, 0), choice_tokens(outs, 1)]


def assert_only_bad_failed(core: EngineCore, message_part: str) -> None:
    outs = run_all(core)
    bad, good = outs["bad"], outs["good"]
    assert bad[-1].finished and bad[-1].error is not None and message_part in bad[-1].error
    assert all(o.error is None for o in good) and good[-1].finished
    assert [choice_tokens(good, 0), choice_tokens(good, 1)] == reference_tokens()
    assert core.blocks.num_used == 0 and not core.scheduler.running and not core.scheduler.waiting


@pytest.mark.parametrize("bad_params", [{}, {"n": 3}, {"logprobs": 2, "prompt_logprobs": 1}])
def test_nan_logits_fail_only_their_request(bad_params: dict[str, object]) -> None:
    core = tiny_core()
    two_requests(core, bad_params)
    poison_hidden(core, lambda seq: seq.request_id == "bad")
    assert_only_bad_failed(core, "non-finite")


def test_a_detokenizer_error_fails_only_its_request() -> None:
    core = tiny_core()
    two_requests(core)

    def broken(token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected tokenizer fault")

    core.requests["bad"].seqs[0].detok.add = broken  # type: ignore[method-assign]
    assert_only_bad_failed(core, "UnicodeDecodeError")


def test_a_sampler_error_on_one_row_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.engine import sample_step

    real_sample: Callable[..., list[Sampled]] = sample_step.sample

    def fussy(logits: torch.Tensor, rows: list) -> list[Sampled]:  # type: ignore[type-arg]
        if any(r.params.top_p == 0.5 for r in rows):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, rows)

    monkeypatch.setattr(sample_step, "sample", fussy)
    core = tiny_core()
    two_requests(core, {"top_p": 0.5})
    assert_only_bad_failed(core, "injected sampler fault")


def test_a_request_the_core_cannot_take_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    core = tiny_core()
    admit = core.scheduler.add

    def picky(seq: Sequence) -> None:
        if seq.request_id == "bad":
            raise ValueError("injected admission fault")
        admit(seq)

    monkeypatch.setattr(core.scheduler, "add", picky)
    two_requests(core)
    assert_only_bad_failed(core, "ValueError: injected admission fault")


def test_fail_all_ends_every_request_with_the_error_and_frees_its_blocks() -> None:
    core = tiny_core()
    two_requests(core)
    core.step()
    assert core.blocks.num_used > 0
    outs = core.fail_all("engine error: injected")
    assert sorted((o.request_id, o.finished, o.error, o.deltas) for o in outs) == [
        ("bad", True, "engine error: injected", []),
        ("good", True, "engine error: injected", []),
    ]
    assert not core.has_work and core.step() == []
    assert core.blocks.num_used == 0 and not core.scheduler.running and not core.scheduler.waiting


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_goes_on() -> None:
    core = tiny_core()
    core.add_request("bad", TOK.encode("first"), greedy(4))
    forward = core.runner.forward
    calls = 0

    def once_broken(batch: list[Scheduled], greedy_keep: list[int] | None = None) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected forward fault")
        return forward(batch, greedy_keep)

    core.runner.forward = once_broken  # type: ignore[method-assign]
    first = core.step()
    assert [(o.request_id, o.finished) for o in first] == [("bad", True)] and first[0].error
    core.add_request("good", TOK.encode("second"), greedy(4))
    outs = run_all(core)["good"]
    assert len(choice_tokens(outs)) == 4 and outs[-1].error is None
    assert core.blocks.num_used == 0


def test_forked_choices_that_each_need_most_of_the_cache_still_finish() -> None:
    core = tiny_core(num_kv_blocks=12)  # 48 slots: one sequence of 8 + 36 tokens at a time
    core.add_request("n", TOK.encode("fork me"), greedy(36, n=3))
    outs = run_all(core)["n"]
    assert [len(choice_tokens(outs, j)) for j in range(3)] == [36, 36, 36]
    assert core.scheduler.num_preemptions > 0 and core.blocks.num_used == 0
