"""The engine shares its steps fairly between the groups of sequences that carry one fairness key
(tokenmill/engine/scheduler.py): every prompt and choice of one HTTP request carries the same key, and each request
its own, so a request of many prompts is one turn, not many."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.api_helpers import body
from tests.api.fake_engine import FakeEngine


def test_a_requests_prompts_share_one_key_and_each_request_has_its_own(client: TestClient, engine: FakeEngine) -> None:
    ids = []
    for prompt in (["a", "b", "c"], "d"):
        response = client.post("/v1/completions", json=body(prompt=prompt, n=2, max_tokens=2))
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    assert [params.fairness_key for _, _, params in engine.requests] == [ids[0]] * 3 + [ids[1]]
