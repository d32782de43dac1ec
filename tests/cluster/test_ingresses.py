"""Two ingress replicas (`tokenmill serve --ingress-replicas 2`) on the tiny model, over real HTTP through Serve's
proxy: a key's rate limit holds across both, /metrics adds both up, and a killed ingress costs neither the limits
nor the counts. The `ray` tier: `make test` runs it in a private network namespace (tests/cluster/ray_server.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.api.scrape import parse, value
from tests.api.server_process import Server
from tests.cluster.ray_server import serve_replicas, skip_unless_private_network
from tests.tiny_model import write_tiny_model
from tokenmill.cluster.ledger import INGRESS_SILENT_S

pytestmark = [pytest.mark.ray, skip_unless_private_network()]

KEYS = ("k-ingress-one", "k-ingress-two")
MODEL = "tiny"
LIMIT = 12  # requests per hour and key: nothing refills within a test
TIMEOUT_S = 60
WAIT_S = 120  # an ingress restarting, on two busy cores


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def ingresses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    flags = ["--replicas", "1", "--ingress-replicas", "2", "--served-model-name", MODEL]
    flags += ["--rate-limit-requests", f"{LIMIT}/h", "--metrics-public"]
    for key in KEYS:
        flags += ["--api-key", key]
    with serve_replicas(model, tmp_path_factory.mktemp("ray"), *flags) as server:
        wait_until(lambda: len(ingress_pids(server)) == 2, "both ingresses to report to the ledger")
        yield server


def complete(server: Server, key: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 1}
    return httpx.post(server.base_url + "/v1/completions", json=body, headers=auth(key), timeout=TIMEOUT_S)


def scrape(server: Server) -> Any:
    response = httpx.get(server.base_url + "/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return parse(response.text)


def ingress_pids(server: Server) -> set[int]:
    return {int(dict(labels)["pid"]) for name, labels in scrape(server) if name == "tokenmill_ingress_info"}


def completions(samples: Any, status: int) -> float:
    return value(samples, "tokenmill_http_requests_total", route="/v1/completions", status=str(status))


def wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.5)


def test_a_keys_limit_holds_across_both_ingresses_and_metrics_add_them_up(ingresses: Server) -> None:
    """Sixteen requests, four at a time, reach both ingresses (Serve's proxy picks one of two for each: all on one
    has odds of 2 x 2^-16); twelve pass, as one process would let them."""
    with ThreadPoolExecutor(4) as pool:
        statuses = sorted(r.status_code for r in pool.map(lambda _: complete(ingresses, KEYS[0]), range(16)))
    assert statuses == [200] * LIMIT + [429] * 4

    def counted() -> bool:  # the ingress that answers the scrape has the other's counts within a push or two
        samples = scrape(ingresses)
        return completions(samples, 200) == LIMIT and completions(samples, 429) == 4

    wait_until(counted, "both ingresses' counts in /metrics")


def test_every_ingress_sends_its_counts_by_itself(ingresses: Server) -> None:
    """A scrape makes only the ingress that answers it push at once; the ledger lists the ingresses heard from in the
    last three seconds, so after a quiet spell both are listed only if the other pushed on its own."""
    time.sleep(INGRESS_SILENT_S + 1)
    assert len(ingress_pids(ingresses)) == 2


def test_a_killed_ingress_loses_neither_the_limits_nor_the_counts(ingresses: Server) -> None:
    """Runs last: it kills an ingress."""
    key = KEYS[1]
    assert [complete(ingresses, key).status_code for _ in range(3)] == [200] * 3
    wait_until(lambda: completions(scrape(ingresses), 200) >= LIMIT + 3, "the three in /metrics")
    before = completions(scrape(ingresses), 200)
    pids = ingress_pids(ingresses)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    answers: list[httpx.Response] = []

    def serving_again() -> bool:  # requests the proxy sent the dead ingress fail until Serve notices
        try:
            answers.append(complete(ingresses, key))
        except httpx.TransportError:
            return False
        return answers[-1].status_code == 200

    wait_until(serving_again, "a completion after the kill")
    charged = 3 + sum(1 for a in answers if a.status_code in (200, 429) or a.status_code >= 500)
    remaining = int(answers[-1].headers["x-ratelimit-remaining-requests"])
    assert remaining <= LIMIT - 4, "the key's bucket outlived the ingress (a fresh one would have 11 left)"
    assert remaining >= LIMIT - charged
    wait_until(lambda: len(ingress_pids(ingresses) - {victim}) == 2, "Serve to start a second ingress again")
    assert completions(scrape(ingresses), 200) >= before + 1  # the counts never went back
