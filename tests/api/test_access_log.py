"""The access log: one line per request (errors, 404s, 401s and streams included, a stream's when it ends), the request
id round trip, the `user` hashed, no prompt or output unless --log-prompts, JSON lines that parse, text lines that no
client-sent text can split."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, body, parse_sse, tiny_engine
from tests.api.fake_engine import FakeEngine
from tests.api.log_capture import captured
from tokenmill.api.app import create_app
from tokenmill.config import Config

KEY = "sk-access-log-key"
PROMPT = "PROMPT-TEXT-THAT-MUST-STAY-OUT-OF-THE-LOG"
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


def tiny_app(**config: Any) -> TestClient:
    return TestClient(create_app(tiny_engine(), Config(**config)), raise_server_exceptions=False)


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("req-123_abc.def:9", True),
        ("b64+/id==", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("has space", False),
        ("new\tline", False),
        ("évil".encode(), False),  # raw UTF-8 bytes on the wire
        ("", False),
    ],
)
def test_a_sane_request_id_comes_back_and_any_other_is_replaced(
    client: TestClient, sent: str | bytes, kept: bool
) -> None:
    with captured("json") as log:
        response = client.get("/v1/models", headers={"x-request-id": sent})
    returned = response.headers["x-request-id"]
    assert returned == sent if kept else GENERATED_ID.fullmatch(returned)
    assert [line["request_id"] for line in log.objects()] == [returned]


def test_every_answer_carries_its_request_id_and_gets_one_line() -> None:
    crashing = TestClient(create_app(FakeEngine(raise_at_step=0), Config()), raise_server_exceptions=False)
    keyed = TestClient(create_app(FakeEngine(), Config(api_key=(KEY,))), raise_server_exceptions=False)
    with captured("json") as log, crashing, keyed:
        responses = [
            keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}),
            keyed.get("/v1/models"),
            keyed.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
            keyed.get("/no/such/path", headers={"Authorization": f"Bearer {KEY}"}),
            keyed.post("/v1/completions", json={"prompt": 1.5}, headers={"Authorization": f"Bearer {KEY}"}),
            keyed.post("/v1/completions", json=body(stream=True), headers={"Authorization": f"Bearer {KEY}"}),
            crashing.post("/v1/completions", json=body()),
        ]
    lines = log.objects()
    assert [r.status_code for r in responses] == [200, 401, 401, 404, 400, 200, 500]
    assert [(line["status"], line["request_id"]) for line in lines] == [
        (r.status_code, r.headers["x-request-id"]) for r in responses
    ]
    errors = [None, "invalid_api_key", "invalid_api_key", "not_found", "invalid_request_error"]
    assert [line.get("error") for line in lines[:5]] == errors
    assert lines[4]["route"] == "/v1/completions" and lines[3]["route"] == "unmatched"
    assert KEY not in log.stream.getvalue() and "wrong" not in log.stream.getvalue()


def test_a_stream_line_is_written_when_it_ends_with_what_it_sent() -> None:
    payload = {"model": TINY_MODEL, "prompt": "hi", "max_tokens": 5, "logit_bias": {"1": -100}, "stream": True}
    with captured("json") as log, tiny_app() as client:
        response = client.post("/v1/completions", json={**payload, "stream_options": {"include_usage": True}})
    usage = parse_sse(response.text)[-2]["usage"]
    (line,) = log.objects()
    assert (line["stream"], line["outcome"], line["finish_reasons"]) == (True, "ok", ["length"])
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], 5)
    assert 0 < line["ttft_ms"] <= line["duration_ms"]


def test_lines_hold_no_prompt_or_output_by_default_and_both_with_log_prompts() -> None:
    payload = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 4, "logit_bias": {"1": -100}}
    lines = {}
    for log_prompts in (False, True):
        with captured("json") as log, tiny_app(log_prompts=log_prompts) as client:
            response = client.post("/v1/completions", json=payload)
        (lines[log_prompts],) = log.objects()
        raw = log.stream.getvalue()
        assert (PROMPT in raw) == log_prompts
    assert "prompt" not in lines[False] and "output" not in lines[False]
    assert lines[True]["prompt"] == PROMPT
    assert lines[True]["output"] == [response.json()["choices"][0]["text"]]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_user_is_logged_as_a_hash_never_as_sent(client: TestClient, log_format: str) -> None:
    user = "alice@example.com"
    with captured(log_format) as log:
        assert client.post("/v1/completions", json=body(user=user)).status_code == 200
    (line,) = log.lines
    assert user not in line and "alice" not in line
    assert hashlib.sha256(user.encode()).hexdigest()[:16] in line


def test_a_text_line_reads_method_path_status_then_its_fields(client: TestClient) -> None:
    with captured("text") as log:
        client.post("/v1/completions", json=body(max_tokens=3), headers={"x-request-id": "abc"})
    (message,) = log.messages
    assert message.startswith("POST /v1/completions 200 duration_ms=")
    fields = dict(pair.split("=", 1) for pair in message.split(" ")[3:])
    assert fields["request_id"] == "abc" and fields["model"] == "fake-model" and fields["stream"] == "false"
    assert (fields["prompt_tokens"], fields["completion_tokens"], fields["finish_reasons"]) == ("3", "3", "length")
    assert "method" not in fields and "path" not in fields  # said once, by the message


def test_no_path_a_client_sends_can_split_a_text_line_or_fake_a_field(client: TestClient) -> None:
    with captured("text") as log:
        client.get("/a%20b%0Arequest_id=forged%22")
    (message,) = log.messages
    head = 'GET "/a b\\nrequest_id=forged\\"" 404 '
    assert message.startswith(head)
    fields = dict(pair.split("=", 1) for pair in message[len(head) :].split(" "))
    assert GENERATED_ID.fullmatch(fields["request_id"])


def test_json_lines_are_objects_with_time_level_and_logger(client: TestClient) -> None:
    with captured("json") as log:
        client.get("/health")
        client.get("/v1/models/" + "%E2%80%A8")  # U+2028, a line separator to some readers: escaped in ASCII JSON
    lines = log.lines
    assert len(lines) == 2 and all(line.isascii() for line in lines)
    for line in log.objects():
        assert {"time", "level", "logger", "message", "method", "path", "status", "request_id"} <= set(line)
        assert line["logger"] == "tokenmill.access" and line["level"] == "INFO"
    assert log.objects()[1]["path"] == "/v1/models/\u2028"
