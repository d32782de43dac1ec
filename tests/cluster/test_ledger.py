"""Several ingresses on one ledger (cluster/ledger.py), in one process: the ledger is called through a stand-in for
its deployment handle, each ingress is the real app on a FakeEngine. A key's limits hold across ingresses, /metrics
on either shows both ingresses' counts and per-user usage, and counts survive an ingress that goes away."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter

from tests.api.api_helpers import MODEL, body, get, post, run
from tests.api.fake_engine import FakeEngine
from tests.api.rate_limit_helpers import FakeClock, rate_headers
from tests.api.scrape import parse, value
from tokenmill.api.app import create_app
from tokenmill.api.record import pseudonym
from tokenmill.cluster.ledger import INGRESS_SILENT_S, Ledger
from tokenmill.cluster.ledger_client import Gains, LedgerClient
from tokenmill.config import Config

KEY = "sk-shared"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Method:
    def __init__(self, call: Callable[..., Any], handle: LedgerHandle, name: str) -> None:
        self.call, self.handle, self.name = call, handle, name

    def remote(self, *args: Any) -> Awaitable[Any]:
        async def answer() -> Any:
            if self.handle.failing.get(self.name, 0) > 0:
                self.handle.failing[self.name] -= 1
                raise ConnectionError("the ledger is restarting")
            return self.call(*args)

        return answer()


class LedgerHandle:
    """What `handle.<method>.remote(...)` does on a Serve deployment handle, on a Ledger in this process."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.failing: dict[str, int] = {}  # method → how many calls to fail

    def __getattr__(self, name: str) -> Method:
        return Method(getattr(self.ledger, name), self, name)


def ingress(handle: LedgerHandle, config: Config, name: str = "a") -> tuple[FastAPI, LedgerClient]:
    client = LedgerClient(handle, True, (name, 100))  # type: ignore[arg-type]  # the stand-in answers as a handle
    app = create_app(FakeEngine(), config, client.books)
    client.count_from(app.state.metrics.counted)
    return app, client


@pytest.fixture
def config() -> Config:
    return Config(api_key=(KEY,), rate_limit_requests="3/min", metrics_public=True)


def test_a_keys_limit_holds_across_ingresses(config: Config) -> None:
    handle = LedgerHandle(Ledger(config, FakeClock()))
    (a, _), (b, _) = ingress(handle, config), ingress(handle, config)
    answers = [run(lambda app=app: post(app, "/v1/completions", body(), AUTH)) for app in (a, b, a, b)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [rate_headers(r.headers)["remaining-requests"] for r in answers] == ["2", "1", "0", "0"]
    assert answers[3].headers["retry-after"] == "20"  # one of three per minute comes back every 20 s


def test_metrics_on_either_ingress_count_every_ingress(config: Config) -> None:
    handle = LedgerHandle(Ledger(config))
    (a, _), (b, _) = ingress(handle, config, "a"), ingress(handle, config, "b")
    for app, user in ((a, "alice"), (b, "alice"), (b, "bob")):
        assert run(lambda app=app, user=user: post(app, "/v1/completions", body(user=user), AUTH)).status_code == 200
    run(lambda: get(b, "/metrics"))  # b sends its counts (every second by itself; at once before it answers)
    samples = parse(run(lambda: get(a, "/metrics")).text)
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status="200") == 3
    assert value(samples, "tokenmill_user_requests", user=pseudonym("alice")) == 2
    assert value(samples, "tokenmill_user_requests", user=pseudonym("bob")) == 1
    assert value(samples, "tokenmill_e2e_request_latency_seconds_count", model=MODEL) == 3
    assert value(samples, "tokenmill_ingress_info", ingress="a", pid="100") == 1
    assert value(samples, "tokenmill_ingress_info", ingress="b", pid="100") == 1


def test_counts_outlive_the_ingress_that_made_them(config: Config) -> None:
    handle = LedgerHandle(Ledger(config))
    (a, _), (b, _) = ingress(handle, config), ingress(handle, config)
    for _ in range(2):
        run(lambda: post(b, "/v1/completions", body(), AUTH))
    run(lambda: get(b, "/metrics"))
    b_again, _ = ingress(handle, config)  # b is gone; its replacement counts from zero
    run(lambda: post(b_again, "/v1/completions", body(), AUTH))
    run(lambda: get(b_again, "/metrics"))
    samples = parse(run(lambda: get(a, "/metrics")).text)
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status="200") == 3


def test_counts_a_push_could_not_send_go_with_the_next(config: Config) -> None:
    handle = LedgerHandle(Ledger(config))
    (a, client), (b, _) = ingress(handle, config), ingress(handle, config)
    run(lambda: post(a, "/v1/completions", body(user="carol"), AUTH))
    handle.failing["push"] = 1
    with pytest.raises(ConnectionError):
        run(client.push)
    run(client.push)
    samples = parse(run(lambda: get(b, "/metrics")).text)
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status="200") == 1
    assert value(samples, "tokenmill_user_requests", user=pseudonym("carol")) == 1


def test_gains_send_a_new_series_once_at_zero_then_only_what_changed() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things", ["kind"], registry=registry)
    counter.labels("a")
    gains = Gains(registry)
    first, values = gains.take()
    assert [(sample, labels, gained) for _, _, _, sample, labels, gained in first] == [
        ("things_total", (("kind", "a"),), 0.0)
    ]
    gains.sent.update(values)
    assert gains.take()[0] == []
    counter.labels("a").inc(2)
    gains.sent.update(gains.take()[1])
    counter.labels("a").inc(3)
    assert [gained for *_, gained in gains.take()[0]] == [3.0]


def test_an_ingress_not_heard_from_for_three_pushes_is_no_longer_listed(config: Config) -> None:
    clock = FakeClock()
    handle = LedgerHandle(Ledger(config, clock))
    (a, _), (b, _) = ingress(handle, config, "a"), ingress(handle, config, "b")
    run(lambda: get(b, "/metrics"))
    clock.advance(INGRESS_SILENT_S + 0.1)
    samples = parse(run(lambda: get(a, "/metrics")).text)
    listed = {dict(labels)["ingress"] for name, labels in samples if name == "tokenmill_ingress_info"}
    assert listed == {"a"}
