"""An engine lost under a request (a replica's process died, tokenmill/cluster/): a non-streamed completion, which
has sent nothing yet, runs once more; a stream that has started ends with a 503 error frame and [DONE]; /health
reports replicas, and "degraded" below the target."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from tests.api.api_helpers import body
from tests.api.fake_engine import SCRIPT, FakeEngine, ReplicatedEngine
from tokenmill.api.app import create_app
from tokenmill.config import Config


def complete(engine: FakeEngine, **fields: Any) -> Any:
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as client:
        return client.post("/v1/completions", json=body(**fields))


def test_a_completion_whose_engine_was_lost_runs_once_more() -> None:
    engine = FakeEngine(lose_at_step=3)
    response = complete(engine, max_tokens=10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == SCRIPT[:10]
    assert response.json()["usage"]["completion_tokens"] == 10  # the lost attempt costs the client nothing
    assert len(engine.requests) == 2


def test_a_completion_lost_twice_is_a_503_that_says_to_retry() -> None:
    response = complete(FakeEngine(lose_at_step=3, losses_left=2), max_tokens=10)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable"
    assert response.headers["retry-after"] == "1"


def test_a_started_stream_whose_engine_was_lost_ends_with_an_error_frame() -> None:
    engine = FakeEngine(lose_at_step=3)
    response = complete(engine, max_tokens=10, stream=True)
    frames = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    texts = [c["text"] for f in frames[:-2] for c in json.loads(f)["choices"]]
    assert "".join(texts) == SCRIPT[:3]  # what was streamed stands
    assert json.loads(frames[-2])["error"]["code"] == "service_unavailable"
    assert len(engine.requests) == 1  # bytes went out: it is not run again


def test_health_reports_replicas_and_degraded_below_the_target() -> None:
    engine = ReplicatedEngine()
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as client:
        full = client.get("/health")
        engine.replicas = 1
        degraded = client.get("/health")
    assert full.json() == {"status": "ok", "models": {"fake-model": {"replicas": 2, "target_replicas": 2}}}
    assert degraded.status_code == 200  # it still serves
    assert degraded.json() == {"status": "degraded", "models": {"fake-model": {"replicas": 1, "target_replicas": 2}}}
    assert engine.refreshes == 2


def test_health_of_one_process_is_as_before(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
