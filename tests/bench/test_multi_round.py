"""The multi-round QA load against a fake OpenAI server: shared system prompt, growing histories, the summary."""

from __future__ import annotations

import asyncio
import itertools

from tests.bench.fake_openai import FakeOpenAI
from tokenmill.bench.multi_round import MultiRoundSettings, report, run_multi_round


def test_each_users_prompts_share_the_system_prompt_and_grow_by_their_own_rounds() -> None:
    fake = FakeOpenAI()
    settings = MultiRoundSettings(
        users=2, rounds=3, qps=40.0, system_words=30, history_words=10, answer_tokens=4, duration_s=0.5
    )
    with fake.running() as url:
        result = asyncio.run(asyncio.wait_for(run_multi_round(url, settings), timeout=30))
    prompts = [body["prompt"] for body in fake.bodies if body.get("stream")]
    system = prompts[0].split("\n")[0]
    assert system.startswith("System: ") and len(system.split()) == 31
    assert all(p.startswith(system + "\nUser ") for p in prompts)
    by_user: dict[str, list[str]] = {}
    for p in prompts:
        by_user.setdefault(p.split("\n")[1].split(":")[0], []).append(p)
    assert len(by_user) >= 2
    for asked in by_user.values():
        for earlier, later in itertools.pairwise(asked):
            assert later.startswith(earlier)  # the earlier prompt, its answer, then the next question
            assert later.count("Question") == earlier.count("Question") + 1
        assert len(asked) <= 3
    assert result["requests"] == len(prompts) and result["failed"] == 0
    assert result["ttft_p90_s"] >= result["ttft_p50_s"] > 0 and result["tok_s"] > 0
    assert "users x 3 rounds" in report(result)
