"""What an engine replica keeps between snapshots (tokenmill/cluster/replica.py)."""

from __future__ import annotations

from tokenmill.cluster.replica import StepLog
from tokenmill.engine.outputs import StepReport


def test_the_step_log_keeps_the_newest_steps_and_counts_the_rest() -> None:
    log = StepLog(limit=3)
    for i in range(5):
        log.observe(StepReport(i / 100, i, i))
    steps, dropped = log.take()
    assert [s.num_seqs for s in steps] == [2, 3, 4] and dropped == 2
    assert log.take() == ([], 0)
