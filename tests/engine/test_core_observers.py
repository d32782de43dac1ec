"""The step observers: told of every step that ran a batch (on the engine thread), never able to fail a request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.engine.tiny import TOK, choice_tokens, greedy, run_all, tiny_core
from tokenmill.engine.engine import AsyncEngine
from tokenmill.engine.outputs import StepReport


def test_each_step_that_ran_a_batch_is_reported_with_its_sequences_and_tokens() -> None:
    core = tiny_core(max_num_batched_tokens=16)  # chunked prefills next to decodes: steps of mixed sizes
    reports: list[StepReport] = []
    core.step_observers.append(reports.append)
    for i, text in enumerate(("a", "the quick brown fox jumps over the lazy dog", "xyz")):
        core.add_request(str(i), TOK.encode(text), greedy(6, n=2 if i == 0 else 1))
    run_all(core)
    stats = core.snapshot_stats()
    assert len(reports) == stats.steps > 0
    assert sum(r.num_tokens for r in reports) == stats.tokens_computed
    assert max(r.num_seqs for r in reports) == stats.max_seqs_in_step > 1
    assert sum(r.num_seqs > 1 for r in reports) == stats.steps_with_multiple_seqs
    assert all(r.duration_s > 0 for r in reports)


def test_an_idle_step_is_not_reported() -> None:
    core = tiny_core()
    reports: list[StepReport] = []
    core.step_observers.append(reports.append)
    assert core.step() == [] and reports == []


def test_a_failing_observer_is_logged_and_fails_no_request(caplog: pytest.LogCaptureFixture) -> None:
    alone, watched = tiny_core(), tiny_core()
    seen: list[StepReport] = []

    def broken(report: StepReport) -> None:
        raise RuntimeError("observer bug")

    watched.step_observers += [broken, seen.append]
    for core in (alone, watched):
        core.add_request("r", TOK.encode("hello"), greedy(8))
    expected = choice_tokens(run_all(alone)["r"])
    outs = run_all(watched)["r"]
    assert choice_tokens(outs) == expected and outs[-1].error is None
    assert len(seen) == watched.stats.steps  # the observer after the broken one still hears of every step
    assert "a step observer failed" in caplog.text


def test_the_async_engine_calls_its_observers_on_the_engine_thread() -> None:
    engine = AsyncEngine(tiny_core(), "tiny", "fp_tiny")
    threads: set[str] = set()
    engine.add_step_observer(lambda report: threads.add(threading.current_thread().name))

    async def scenario() -> None:
        await engine.start()
        try:
            async for _ in engine.generate("r", TOK.encode("hi"), greedy(4)):
                pass
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert threads and all(name.startswith("tokenmill-engine") for name in threads)
