"""RemoteEngine, the ingress's engine behind the Engine protocol: retries, lost streams, cancellation, snapshots."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.api.api_helpers import missing_members
from tests.cluster.remote_fakes import DIED, FakeHandle, output
from tests.tiny_model import tiny_tokenizer
from tokenmill.api.engine_protocol import Engine
from tokenmill.cluster.remote_engine import RemoteEngine
from tokenmill.cluster.replica import ReplicaInfo, ReplicaSnapshot
from tokenmill.engine.core import EngineStats
from tokenmill.engine.outputs import RequestOutput, StepReport
from tokenmill.engine.sampling import SamplingParams


def engine(handle: FakeHandle, target: int = 2) -> RemoteEngine:
    info = ReplicaInfo("tiny", "fp_x", 256, tiny_tokenizer(), None)
    return RemoteEngine(handle, info, target)  # type: ignore[arg-type]


def collect(remote: RemoteEngine, limit: int | None = None) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        generator = remote.generate("r", [5, 6], SamplingParams())
        async for out in generator:
            outputs.append(out)
            if limit is not None and len(outputs) == limit:
                break
        await generator.aclose()  # type: ignore[attr-defined]
        return outputs

    return asyncio.run(go())


def test_a_replica_lost_before_answering_is_sent_the_prompt_again() -> None:
    handle = FakeHandle([[DIED], [output("r", "a"), output("r", "b", finished=True)]])
    remote = engine(handle)
    outputs = collect(remote)
    assert [o.deltas[0].text for o in outputs] == ["a", "b"] and not any(o.lost for o in outputs)
    assert remote.retries == 1 and len(handle.streams) == 2


def test_a_replica_lost_after_answering_ends_the_stream_as_lost() -> None:
    handle = FakeHandle([[output("r", "a"), DIED], [output("r", "never")]])
    outputs = collect(engine(handle))
    assert outputs[0].deltas[0].text == "a"
    assert outputs[1].lost and outputs[1].finished and outputs[1].error is not None
    assert len(handle.streams) == 1  # its first output went to the client: no second try here


def test_a_prompt_lost_twice_is_lost() -> None:
    outputs = collect(engine(FakeHandle([[DIED], [DIED]])))
    assert len(outputs) == 1 and outputs[0].lost


def test_a_consumer_that_stops_early_cancels_the_replica_stream() -> None:
    handle = FakeHandle([[output("r", "a"), output("r", "b"), output("r", "c", finished=True)]])
    assert len(collect(engine(handle), limit=1)) == 1
    assert handle.streams[0].cancelled


def test_each_prompt_is_a_call_of_its_own_to_ray() -> None:
    handle = FakeHandle([[output("r", "a", finished=True)], [output("r", "b", finished=True)]])
    remote = engine(handle)
    collect(remote)
    collect(remote)
    assert len(set(handle.internal_ids)) == 2 and "" not in handle.internal_ids


def snapshot(replica: str, tokens: int, steps: int, dropped: int = 0) -> ReplicaSnapshot:
    stats = EngineStats(steps=steps, tokens_computed=tokens, max_seqs_in_step=steps, num_running=1)
    return ReplicaSnapshot(replica, 100, stats, [StepReport(0.01, 1, 1)] * steps, dropped)


def test_a_refresh_adds_up_every_replica_and_replays_its_steps() -> None:
    handle = FakeHandle(snapshots=[snapshot("b", 30, 3, dropped=4), RuntimeError("gone"), snapshot("a", 12, 2)])
    remote, seen = engine(handle, target=3), []
    remote.add_step_observer(seen.append)
    assert remote.is_healthy()  # before any refresh: the replica that connect() reached
    asyncio.run(remote.refresh())
    assert [s.replica for s in remote.snapshots] == ["a", "b"]
    stats = remote.stats()
    assert (stats.tokens_computed, stats.steps, stats.num_running, stats.max_seqs_in_step) == (42, 5, 2, 3)
    assert len(seen) == 5 and remote.steps_dropped == 4
    assert remote.health() == {"replicas": 2, "target_replicas": 3}


def test_refreshes_at_once_share_one_round_and_none_left_is_unhealthy() -> None:
    handle = FakeHandle(snapshots=[])
    remote = engine(handle)

    async def burst() -> Any:
        await asyncio.gather(*(remote.refresh() for _ in range(5)))

    asyncio.run(burst())
    assert handle.broadcasts == 1
    assert not remote.is_healthy()


def test_it_answers_the_whole_engine_protocol_starting_and_stopping_nothing() -> None:
    remote = engine(FakeHandle([]))
    assert missing_members(Engine, remote) == []
    assert asyncio.run(remote.start()) is None and asyncio.run(remote.stop()) is None and remote.is_healthy()
