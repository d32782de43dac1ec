"""`tokenmill serve --replicas 4 --simulate-engine --ingress-replicas 2` over real HTTP: the simulated replicas answer
through the whole front door, and a conversation's next round finds its history cached wherever its ingress sent it
(both ingresses read the replicas' reports of the blocks they hold). The `ray` tier (tests/cluster/ray_server.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.server_process import Server
from tests.cluster.ray_server import serve_replicas, skip_unless_private_network
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.ray, skip_unless_private_network()]

MODEL = "tiny"
TIMEOUT_S = 60
REPORT_WAIT_S = 2.5  # the replicas report the blocks they hold every second
SYSTEM = "the capital of France is Paris and the world is hello " * 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    flags = ("--replicas", "4", "--simulate-engine", "--ingress-replicas", "2", "--served-model-name", MODEL)
    with serve_replicas(model, tmp_path_factory.mktemp("ray"), *flags) as server:
        yield server


def complete(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_a_simulated_replica_answers_max_tokens_tokens_through_the_front_door(fleet: Server) -> None:
    answer = complete(fleet, "hello world", 7)
    assert answer["usage"]["completion_tokens"] == 7 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["system_fingerprint"] == "fp_simulated"


def test_each_round_of_a_conversation_finds_its_history_cached(fleet: Server) -> None:
    """Three users share a system prompt; each one's rounds grow its own history. A round that reached a replica not
    holding the user's history would find only the system prompt cached."""
    histories = [SYSTEM + f"user {u} says " + " ".join(["world hello"] * (20 + 7 * u)) for u in range(3)]
    for round_ in range(3):
        for u, history in enumerate(histories):
            prompt = history + f" question {round_} of the capital"
            answer = complete(fleet, prompt, 4)
            if round_ > 0:
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                own = answer["usage"]["prompt_tokens"]
                assert cached >= 0.6 * own, (u, round_, cached, own)
            histories[u] = prompt + answer["choices"][0]["text"]
        time.sleep(REPORT_WAIT_S)
