"""What an engine replica keeps between snapshots (tokenmill/cluster/replica.py)."""

from __future__ import annotations

from tokenmill.cluster.replica import StepLog, summed
from tokenmill.engine.core import EngineStats
from tokenmill.engine.outputs import StepReport


def test_the_step_log_keeps_the_newest_steps_and_counts_the_rest() -> None:
    log = StepLog(limit=3)
    for i in range(5):
        log.observe(StepReport(i / 100, i, i))
    steps, dropped = log.take()
    assert [s.num_seqs for s in steps] == [2, 3, 4] and dropped == 2
    assert log.take() == ([], 0)


def test_replicas_counters_add_up_and_per_position_counts_position_by_position() -> None:
    a = EngineStats(steps=3, max_seqs_in_step=2, spec_drafts=1, spec_accepted_per_position=[4, 2])
    b = EngineStats(steps=5, max_seqs_in_step=7, spec_drafts=2, spec_accepted_per_position=[1, 1, 1])
    total = summed([a, b])
    assert (total.steps, total.max_seqs_in_step, total.spec_drafts) == (8, 7, 3)
    assert total.spec_accepted_per_position == [5, 3, 1]
