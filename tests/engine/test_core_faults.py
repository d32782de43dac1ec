"""A fault that belongs to one request fails that request alone; the others finish as if nothing happened."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.engine.test_core import TOK, choice_tokens, greedy, run_all
from tests.engine.tiny import tiny_core
from tokenmill.engine.core import EngineCore
from tokenmill.engine.sampler import Sampled
from tokenmill.engine.scheduler import Scheduled
from tokenmill.engine.sequence import Sequence


def poison_hidden(core: EngineCore, is_bad: Callable[[Sequence], bool]) -> None:
    """Every forward pass writes NaN into the hidden states of the rows of sequences that `is_bad` picks."""
    forward = core.runner.forward

    def poisoned(batch: list[Scheduled]) -> torch.Tensor:
        hidden = forward(batch)
        row = 0
        with torch.inference_mode():
            for s in batch:
                if is_bad(s.seq):
                    hidden[row : row + s.num_tokens] = float("nan")
                row += s.num_tokens
        return hidden

    core.runner.forward = poisoned  # type: ignore[method-assign]


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
    import tokenmill.engine.core as core_module

    real_sample: Callable[..., list[Sampled]] = core_module.sample

    def fussy(logits: torch.Tensor, rows: list) -> list[Sampled]:  # type: ignore[type-arg]
        if any(r.params.top_p == 0.5 for r in rows):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, rows)

    monkeypatch.setattr(core_module, "sample", fussy)
    core = tiny_core()
    two_requests(core, {"top_p": 0.5})
    assert_only_bad_failed(core, "injected sampler fault")


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_goes_on() -> None:
    core = tiny_core()
    core.add_request("bad", TOK.encode("first"), greedy(4))
    forward = core.runner.forward
    calls = 0

    def once_broken(batch: list[Scheduled]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected forward fault")
        return forward(batch)

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
