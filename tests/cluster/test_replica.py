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


def test_a_replica_reports_the_prefix_blocks_it_holds_as_the_router_keys_a_prompt() -> None:
    """What record_routing_stats tells the router (every few seconds, through Ray Serve): the keys of the blocks a
    served prompt left cached, the same as the router computes from that prompt's ids (cluster/router.py)."""
    import asyncio
    from types import SimpleNamespace

    from tests.engine.tiny import tiny_core
    from tokenmill.cluster.replica import EngineReplica
    from tokenmill.cluster.router import HELD_BLOCKS, PREFILL_BACKLOG, block_keys
    from tokenmill.engine.engine import AsyncEngine
    from tokenmill.engine.sampling import SamplingParams

    prompt = list(range(10, 40))  # seven whole blocks of 4 before its last token

    async def serve_one() -> dict[str, list[int]]:
        engine = AsyncEngine(tiny_core(), "tiny", "fp_tiny")
        replica = SimpleNamespace(engine=engine)  # the method's `self`: its constructor needs a Serve replica
        await engine.start()
        try:
            async for _ in engine.generate("r", prompt, SamplingParams(max_tokens=1)):
                pass
            return await EngineReplica.record_routing_stats(replica)  # type: ignore[arg-type]
        finally:
            await engine.stop()

    stats = asyncio.run(asyncio.wait_for(serve_one(), timeout=60))
    keys = block_keys(prompt + [99], None, 4)  # a next prompt that starts with this one
    assert len(keys) == 7 and set(keys) <= set(stats[HELD_BLOCKS])
    assert stats[PREFILL_BACKLOG] == 0  # its one prompt was prefilled and answered
