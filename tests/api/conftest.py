from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.api.fake_engine import FakeEngine
from tokenmill.api.app import create_app
from tokenmill.config import Config


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as test_client:
        yield test_client
