"""The simulated engine (cluster/simulated.py) on its own: it batches as the real engine schedules, answers each
prompt with max_tokens tokens, reuses a cached prefix and reports its blocks with the router's keys, and drops a
request whose caller stopped listening. Service times are shrunk so a test takes milliseconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.api.fake_engine import CharTokenizer
from tests.tiny_model import write_tiny_model
from tokenmill.cluster.router import block_keys
from tokenmill.cluster.sim.replica import ServiceTimes
from tokenmill.cluster.simulated import SimulatedEngine
from tokenmill.config import Config
from tokenmill.engine.outputs import FinishReason, RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.server.load import load_tokenizer

FAST = ServiceTimes(t_fixed=0.002, t_per_seq=0.0001, t_per_prefill_token=0.00001, s_router=0.001)
CONFIG = Config(block_size=4, served_model_name=("sim",))
TIMEOUT_S = 30


def engine() -> SimulatedEngine:
    return SimulatedEngine(CONFIG, CharTokenizer(), FAST)  # type: ignore[arg-type]  # the protocol's members


async def outputs(sim: SimulatedEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[RequestOutput]:
    return [out async for out in sim.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens, n=2))]


def test_prompts_at_once_share_steps_and_each_gets_max_tokens() -> None:
    async def run() -> list[list[RequestOutput]]:
        sim = engine()
        await sim.start()
        try:
            prompts = [[5 + i] * 9 for i in range(4)]
            return await asyncio.wait_for(
                asyncio.gather(*(outputs(sim, f"r{i}", p, 6) for i, p in enumerate(prompts))), TIMEOUT_S
            )
        finally:
            stats = sim.stats()
            await sim.stop()
            assert stats.steps < 4 * 6 and stats.max_seqs_in_step == 4 and stats.num_running == 0

    for answers in asyncio.run(run()):
        assert len(answers) == 6 and answers[-1].finished and not any(a.finished for a in answers[:-1])
        last = answers[-1].deltas
        assert [d.index for d in last] == [0, 1]  # every one of the n sequences
        assert all(d.finish_reason == FinishReason.LENGTH and d.num_tokens == 6 for d in last)
        assert "".join(a.deltas[0].text for a in answers) == engine().text * 6  # one token a step


def test_a_shared_prefix_is_cached_and_reported_with_the_routers_keys() -> None:
    first, second = [7] * 13, [7] * 12 + [9, 9, 9]

    async def run() -> tuple[int, int, list[int]]:
        sim = engine()
        await sim.start()
        try:
            a = await asyncio.wait_for(outputs(sim, "a", first, 2), TIMEOUT_S)
            b = await asyncio.wait_for(outputs(sim, "b", second, 2), TIMEOUT_S)
            return a[0].num_cached_tokens, b[0].num_cached_tokens, sim.held_keys(100)
        finally:
            await sim.stop()

    cold, warm, held = asyncio.run(run())
    assert (cold, warm) == (0, 12)  # three whole blocks of four before the last prompt token
    assert set(block_keys(second, None, 4)) <= set(held)
    assert held[0] == block_keys(second, None, 4)[-1]  # the most recently used first


def test_a_request_whose_caller_leaves_frees_its_place() -> None:
    async def run() -> int:
        sim = engine()
        await sim.start()
        try:
            stream = sim.generate("gone", [5] * 8, SamplingParams(max_tokens=10_000))
            await asyncio.wait_for(anext(stream), TIMEOUT_S)
            await stream.aclose()
            await asyncio.sleep(0.05)  # a step or two
            return sim.stats().num_running
        finally:
            await sim.stop()

    assert asyncio.run(run()) == 0


def test_it_reads_only_the_models_tokenizer(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    (model / "model.safetensors").unlink()  # no weights needed
    tokenizer = load_tokenizer(Config(model=(str(model),)))
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"


def test_service_times_of_another_model_are_read_from_the_config() -> None:
    config = Config(replicas=2, simulate_engine=True, simulated_service_times="0.0464, 0.0035,0.0059")
    assert config.service_times() == (0.0464, 0.0035, 0.0059)
    assert Config(replicas=2, simulate_engine=True).service_times() is None
