from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from fastapi import FastAPI

from tests.api.api_helpers import body, call_then_disconnect, post, run, stream
from tests.api.fake_engine import SCRIPT, FakeEngine
from tokenmill.api.app import create_app
from tokenmill.api.logprobs import empty_logprobs, extend_logprobs
from tokenmill.config import Config


@pytest.fixture
def app(engine: FakeEngine) -> FastAPI:
    return create_app(engine, Config())


def chunks_of(events: list[Any]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return events[:-1]


def joined(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: the concatenated text, merged logprobs and every finish_reason seen (in order)."""
    out: dict[int, dict[str, Any]] = defaultdict(lambda: {"text": "", "logprobs": None, "finish": []})
    for chunk in chunks:
        for c in chunk["choices"]:
            entry = out[c["index"]]
            entry["text"] += c["text"]
            entry["finish"].append(c["finish_reason"])
            if c["logprobs"] is not None:
                entry["logprobs"] = entry["logprobs"] or empty_logprobs()
                extend_logprobs(entry["logprobs"], c["logprobs"])
    return dict(out)


STREAM_CASES: list[dict[str, Any]] = [
    body(),
    body(max_tokens=100),
    body(prompt=["ab", "cd"], n=2, max_tokens=5),
    body(prompt=[[5, 6], [7]], max_tokens=3, echo=True),
    body(prompt="Hi", echo=True, logprobs=2, max_tokens=4),
    body(prompt="Hi", echo=True, logprobs=1, max_tokens=0),
    body(stop=["fox"], max_tokens=100, logprobs=0),
    body(n=3, max_tokens=7),
]


@pytest.mark.parametrize("payload", STREAM_CASES)
def test_stream_matches_non_stream(app: FastAPI, payload: dict[str, Any]) -> None:
    plain = run(lambda: post(app, "/v1/completions", payload)).json()
    response, events = stream(app, payload | {"stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = chunks_of(events)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == "fake-model" for c in chunks)
    assert all(c["system_fingerprint"] == "fp_fake" and "usage" not in c for c in chunks)
    per_choice = joined(chunks)
    assert sorted(per_choice) == [c["index"] for c in plain["choices"]]
    for choice in plain["choices"]:
        streamed = per_choice[choice["index"]]
        assert streamed["text"] == choice["text"]
        assert streamed["logprobs"] == choice["logprobs"]
        assert streamed["finish"][-1] == choice["finish_reason"]  # exactly once, in the choice's last chunk
        assert all(f is None for f in streamed["finish"][:-1])


def test_each_chunk_carries_one_choice(app: FastAPI) -> None:
    _, events = stream(app, body(prompt=["a", "b"], n=2, max_tokens=3, stream=True))
    assert all(len(c["choices"]) == 1 for c in chunks_of(events))


def test_echo_comes_in_the_first_chunk_of_each_choice(app: FastAPI) -> None:
    _, events = stream(app, body(prompt=["Hi ", "Yo "], n=2, echo=True, max_tokens=3, stream=True))
    first: dict[int, str] = {}
    for chunk in chunks_of(events):
        for c in chunk["choices"]:
            first.setdefault(c["index"], c["text"])
    assert first == {0: "Hi T", 1: "Hi h", 2: "Yo T", 3: "Yo h"}


def test_include_usage_adds_a_final_usage_chunk(app: FastAPI) -> None:
    payload = body(prompt=["ab", "c"], n=2, max_tokens=4, stream=True, stream_options={"include_usage": True})
    _, events = stream(app, payload)
    chunks = chunks_of(events)
    *content, last = chunks
    assert all(c["usage"] is None and c["choices"] for c in content)
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 16,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert last["id"] == content[0]["id"]


def test_continuous_usage_stats_gives_each_chunk_its_choice_s_usage_so_far(app: FastAPI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    payload = body(prompt=["ab", "c"], n=2, max_tokens=4, stream=True, stream_options=options)
    _, events = stream(app, payload)
    *content, last = chunks_of(events)
    seen: dict[int, list[int]] = defaultdict(list)
    for chunk in content:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == (3 if choice["index"] < 2 else 2)  # its own prompt's tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[choice["index"]].append(usage["completion_tokens"])
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(counts == sorted(counts) and counts[-1] == 4 for counts in seen.values())  # growing, to the end
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16  # the request's, as without it


@pytest.mark.parametrize("options", [{"continuous_usage_stats": False}, {"continuous_usage_stats": True}])
def test_continuous_usage_stats_without_include_usage_adds_nothing(app: FastAPI, options: dict[str, bool]) -> None:
    response, events = stream(app, body(max_tokens=3, stream=True, stream_options=options))
    assert response.status_code == 200
    assert all("usage" not in chunk for chunk in chunks_of(events))


def test_obfuscation_is_added_when_asked(app: FastAPI) -> None:
    payload = body(max_tokens=3, stream=True, stream_options={"include_obfuscation": True})
    _, events = stream(app, payload)
    chunks = chunks_of(events)
    assert all(isinstance(c["obfuscation"], str) and c["obfuscation"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT[:3]


@pytest.mark.parametrize(
    "engine",
    [FakeEngine(error_at_step=3), FakeEngine(raise_at_step=3), FakeEngine(abort_at_step=3)],
    ids=["error-output", "exception", "abort"],
)
def test_error_after_the_stream_started_is_an_error_frame_then_done(engine: FakeEngine, app: FastAPI) -> None:
    response, events = stream(app, body(max_tokens=10, stream=True))
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    *content, error = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in content) == SCRIPT[:3]
    assert error["error"]["type"] == "server_error"
    assert set(error["error"]) == {"message", "type", "param", "code"}


def test_stream_validation_errors_are_plain_400s(app: FastAPI) -> None:
    response = run(lambda: post(app, "/v1/completions", body(stream=True, prompt=[99999])))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_client_disconnect_mid_stream_aborts_every_engine_request(app: FastAPI, engine: FakeEngine) -> None:
    engine.hang_at_step = 2
    payload = body(prompt=["a", "b"], max_tokens=10, stream=True)

    def after_first_chunk(sent: list[dict[str, Any]]) -> bool:
        return any(m["type"] == "http.response.body" and m.get("body") for m in sent)

    sent = run(lambda: call_then_disconnect(app, payload, after_first_chunk))
    assert sent[0]["status"] == 200
    assert sorted(engine.aborted) == sorted(rid for rid, _, _ in engine.requests)
    assert len(engine.aborted) == 2 and not engine.completed


def test_client_disconnect_while_waiting_aborts_a_non_stream_request(app: FastAPI, engine: FakeEngine) -> None:
    engine.hang_at_step = 2
    payload = body(prompt=["a", "b"], n=2, max_tokens=10)
    sent = run(lambda: call_then_disconnect(app, payload, lambda _: len(engine.requests) == 2))
    assert len(engine.aborted) == 2 and not engine.completed
    assert sent[0]["status"] == 499


def test_a_finished_stream_leaves_nothing_aborted(app: FastAPI, engine: FakeEngine) -> None:
    stream(app, body(prompt=["a", "b"], max_tokens=5, stream=True))
    assert engine.aborted == [] and len(engine.completed) == 2
