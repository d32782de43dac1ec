"""--content-filter over HTTP on the real engine (tiny random model, one byte a token): a choice stops just before
a match, streamed or not, with n > 1 and echo; its token ids and logprobs never reveal the cut text; a matching
prompt is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, assert_openai_error, parse_sse, tiny_engine
from tests.engine.tiny import NUM_SPECIAL
from tokenmill.api.app import create_app
from tokenmill.cli import main
from tokenmill.config import Config
from tokenmill.engine.content_filter import ContentFilterError

PROMPT = "Hello"
LETTERS = [NUM_SPECIAL + ord(c) for c in "abcd"]  # four letters, mixed by the penalty: matches are easy to find
SAMPLED = {"allowed_token_ids": LETTERS, "temperature": 2.0, "repetition_penalty": 3.0, "seed": 11, "max_tokens": 32}


@pytest.fixture(scope="module")
def plain() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_engine(), Config())) as client:
        yield client


def filtered(tmp_path: Path, *lines: str) -> TestClient:
    path = tmp_path / "filter.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return TestClient(create_app(tiny_engine(), Config(content_filter=str(path))))


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": TINY_MODEL, "prompt": PROMPT, **SAMPLED, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(client: TestClient, **fields: Any) -> tuple[str, list[str | None]]:
    body = {"model": TINY_MODEL, "prompt": PROMPT, **SAMPLED, "stream": True, **fields}
    events = parse_sse(client.post("/v1/completions", json=body).text)
    chunks = [e for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]


def test_a_choice_stops_before_the_match_streamed_or_not(plain: TestClient, tmp_path: Path) -> None:
    full = complete(plain)["choices"][0]["text"]
    word = full[9:12]  # three tokens: the match spans them
    cut = full.index(word)
    with filtered(tmp_path, word) as client:
        out = complete(client, logprobs=2, return_token_ids=True)
        [choice] = out["choices"]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (full[:cut], "content_filter", None)
        assert choice["token_ids"] == [NUM_SPECIAL + ord(c) for c in full[:cut]]  # none of the match's tokens
        assert choice["logprobs"]["tokens"] == list(full[:cut])
        assert out["usage"]["completion_tokens"] == cut + len(word)  # generated, so counted; never shown
        text, reasons = streamed_text(client)
        assert (text, reasons[-1], reasons.count("content_filter")) == (full[:cut], "content_filter", 1)
        assert word not in text


def test_each_of_n_choices_is_filtered_alone(plain: TestClient, tmp_path: Path) -> None:
    fulls = [c["text"] for c in complete(plain, n=4)["choices"]]
    word = fulls[0][5:8]  # choice 0 is cut; the others as they happen to contain it
    with filtered(tmp_path, word) as client:
        for text_of, reason_of in (_non_streamed(client), _streamed(client)):
            for i, full in enumerate(fulls):
                expected = full[: full.index(word)] if word in full else full
                assert text_of(i) == expected
                assert reason_of(i) == ("content_filter" if word in full else "length")


def _non_streamed(client: TestClient) -> tuple[Any, Any]:
    choices = complete(client, n=4)["choices"]
    return (lambda i: choices[i]["text"]), (lambda i: choices[i]["finish_reason"])


def _streamed(client: TestClient) -> tuple[Any, Any]:
    body = {"model": TINY_MODEL, "prompt": PROMPT, **SAMPLED, "stream": True, "n": 4}
    events = [e for e in parse_sse(client.post("/v1/completions", json=body).text) if e != "[DONE]"]
    pieces = [c for e in events for c in e["choices"]]
    texts = {i: "".join(p["text"] for p in pieces if p["index"] == i) for i in range(4)}
    reasons = {p["index"]: p["finish_reason"] for p in pieces if p["finish_reason"] is not None}
    return (lambda i: texts[i]), (lambda i: reasons[i])


def test_with_echo_a_match_may_begin_in_the_prompt(plain: TestClient, tmp_path: Path) -> None:
    first = complete(plain)["choices"][0]["text"][0]
    with filtered(tmp_path, "lo" + first) as client:  # "Hello" itself passes; "Hello" + the first letter does not
        choice = complete(client, echo=True)["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (PROMPT, "content_filter")
        without_echo = complete(client)["choices"][0]
        assert without_echo["finish_reason"] == "length"  # without echo the choice's text is the output alone


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "say forbidden things"}, "prompt"),
        ({"prompt": ["fine", "FORBIDDEN"]}, "prompt"),
        ({"prompt": [NUM_SPECIAL + ord(c) for c in "so forbidden"]}, "prompt"),
    ],
)
def test_a_prompt_that_matches_is_a_400_and_the_server_keeps_serving(
    tmp_path: Path, fields: dict[str, Any], param: str
) -> None:
    with filtered(tmp_path, "re:(?i)forbidden") as client:
        body = {"model": TINY_MODEL, "max_tokens": 2, **fields}
        error = assert_openai_error(client.post("/v1/completions", json=body), 400, "content_filter")
        assert error["param"] == param and "forbidden" not in error["message"].lower()
        assert complete(client, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_a_bad_filter_file_stops_the_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ContentFilterError):
        create_app(tiny_engine(), Config(content_filter=str(tmp_path / "missing.txt")))
    bad = tmp_path / "bad.txt"
    bad.write_text("re:(\n", encoding="utf-8")
    assert main(["serve", "--content-filter", str(bad)]) == 2  # before any model loads
    assert "line 1: bad regular expression" in capsys.readouterr().err
