"""Every engine the app is built around, and every tokenizer, answers every member of the HTTP edge's protocols
(api/engine_protocol.py), with a no-op or None where it has nothing: the app never asks whether one has a member.
cluster/'s RemoteEngine is checked beside its own tests (tests/cluster/test_remote_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.api_helpers import missing_members, tiny_engine
from tests.api.fake_engine import CharTokenizer, FakeEngine, ReplicatedEngine
from tests.engine.tiny import ByteTokenizer
from tests.tiny_model import tiny_tokenizer
from tokenmill.api.engine_protocol import Engine, Tokenizer
from tokenmill.engine.engine import AsyncEngine


@pytest.mark.parametrize("make", [tiny_engine, FakeEngine, ReplicatedEngine], ids=lambda make: make.__name__)
def test_every_engine_answers_the_whole_protocol(make: type) -> None:
    assert missing_members(Engine, make()) == []


@pytest.mark.parametrize("make", [tiny_tokenizer, CharTokenizer, ByteTokenizer], ids=lambda make: make.__name__)
def test_every_tokenizer_answers_the_whole_protocol(make: type) -> None:
    tokenizer = make()
    assert missing_members(Tokenizer, tokenizer) == []
    assert tokenizer.chat_template is None and isinstance(tokenizer.add_bos, bool)
    assert tokenizer.id_to_token(tokenizer.encode("a", add_special_tokens=False)[0]) in ("a", "▁a")


def test_one_engine_in_process_has_no_replicas_and_nothing_to_refresh() -> None:
    engine: AsyncEngine = tiny_engine()
    assert engine.health() is None and asyncio.run(engine.refresh()) is None
    assert FakeEngine().health() is None and ReplicatedEngine().health() == {"replicas": 2, "target_replicas": 2}
