"""scripts/served_level.py's pure parts: the step totals read from a tokenmill server's /metrics, and the threads'
CPU times read from /proc. No servers."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.bench.scripts import load_script
from tokenmill.api.metrics import Metrics
from tokenmill.engine.outputs import StepReport

sl = load_script("served_level")


def test_step_totals_add_up_every_models_steps_from_the_servers_own_exposition() -> None:
    metrics = Metrics({})
    for model, durations in {"a": [0.02, 0.03], "b": [0.5]}.items():
        observe = metrics.step_observer(model)
        for d in durations:
            observe(StepReport(duration_s=d, num_seqs=16, num_tokens=16))
    for accept in (None, "application/openmetrics-text"):  # both encodings a scrape may get
        body, _ = metrics.exposition(accept)
        steps, seconds = sl.step_totals(body.decode())
        assert steps == 3
        assert seconds == pytest.approx(0.55)


def test_step_totals_of_a_server_without_steps_are_zero() -> None:
    body, _ = Metrics({}).exposition(None)
    assert sl.step_totals(body.decode()) == (0.0, 0.0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux's /proc tells each thread's times")
def test_thread_times_see_a_busy_thread_of_this_process() -> None:
    """The thread spins until it has had 0.2 s of CPU by its own clock, however long a busy machine makes that."""
    busy, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def spin() -> None:
        tid.append(threading.get_native_id())
        while time.thread_time() < 0.2:
            pass
        busy.set()
        done.wait(60)

    worker = threading.Thread(target=spin)
    worker.start()
    assert busy.wait(120)
    times = sl.thread_times(os.getpid())
    done.set()
    worker.join()
    on_cpu, waiting = times[tid[0]]
    assert on_cpu >= 0.19 and waiting >= 0
