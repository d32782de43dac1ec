"""bench/busy.py: the competitor spins while the block runs, and is gone when it ends."""

from __future__ import annotations

import os
import time

from tokenmill.bench.busy import busy_process


def test_the_competitor_takes_cpu_while_the_block_runs_and_is_waited_for() -> None:
    before = os.times()
    start = time.perf_counter()
    with busy_process(on_ms=2.0, off_ms=1.0):
        time.sleep(0.6)
    elapsed = time.perf_counter() - start
    after = os.times()  # a child's CPU time counts here only once it has been waited for
    spent = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    assert spent > 0.1  # ~2/3 of 0.6 s less its start-up
    assert elapsed < 5.0
