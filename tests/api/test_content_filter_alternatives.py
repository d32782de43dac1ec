"""--content-filter over logprobs' alternatives, on the real engine with a Gemma-shaped tiny vocabulary (words such as
"hello" are tokens): no alternative that contains a match, or completes one after the text before it, leaves the
server in top_logprobs (generated or echoed, streamed or not) or in prompt_logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import regex
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, parse_sse
from tests.api.gemma_vocab import gemma_vocab_engine
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine.content_filter import ContentFilter

PROMPT = "the capital of France is Paris"
BODY = {"model": TINY_MODEL, "prompt": PROMPT, "echo": True, "logprobs": 5, "prompt_logprobs": 20, "max_tokens": 8}
WORD = "hell"  # not in the prompt; " hell", "hell" and " hello" are tokens the tiny model weighs beside it


@pytest.fixture(scope="module")
def plain() -> Iterator[TestClient]:
    with TestClient(create_app(gemma_vocab_engine(), Config())) as client:
        yield client


def filtered(tmp_path: Path, line: str) -> TestClient:
    path = tmp_path / "filter.txt"
    path.write_text(line + "\n", encoding="utf-8")
    return TestClient(create_app(gemma_vocab_engine(), Config(content_filter=str(path))))


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={**BODY, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    return choice


def streamed_logprobs(client: TestClient) -> dict[str, list[Any]]:
    events = parse_sse(client.post("/v1/completions", json={**BODY, "temperature": 0, "stream": True}).text)
    joined: dict[str, list[Any]] = {"tokens": [], "top_logprobs": []}
    for event in events[:-1]:
        for choice in event["choices"]:
            for key in joined:
                joined[key] += (choice["logprobs"] or {}).get(key, [])
    return joined


def shown_alternatives(choice: dict[str, Any]) -> list[tuple[str, str]]:
    """(the text before it, the alternative's text) for every alternative the choice shows, in top_logprobs and in
    prompt_logprobs (echoed, so the prompt's text before position i is its first i tokens)."""
    tokens, shown = choice["logprobs"]["tokens"], []
    for i, top in enumerate(choice["logprobs"]["top_logprobs"]):
        shown += [("".join(tokens[:i]), key) for key in top or {} if key != tokens[i]]
    prompt_ids = choice["prompt_token_ids"]
    for i, position in enumerate(choice["prompt_logprobs"]):
        others = {token_id: entry for token_id, entry in (position or {}).items() if token_id != str(prompt_ids[i])}
        shown += [("".join(tokens[:i]), entry["decoded_token"]) for entry in others.values()]
    return shown


def matching(pattern: str, shown: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(before, text) for before, text in shown if regex.search(pattern, before + text)]


CHECKS: list[tuple[str, str, str, bool]] = [  # (filter line, text before, alternative, shown)
    ("forbidden", "it is forbid", "den", False),  # completes a match that began in the text
    ("forbidden", "", "forbidden fruit", False),
    ("forbidden", "", "forbid", True),  # only begins one: a single guess, nothing completes it
    ("forbidden", "x" * 500 + " forbid", "den", False),  # the text in front is read as far back as a match can reach
    ("re:\\bcat\\b", "a", "cat", True),
    ("re:\\bcat\\b", "a ", "cat", False),
    ("re:(?i)secret\\s+code", "the SECRET", "  Code", False),
]


@pytest.mark.parametrize(("line", "before", "alternative", "shown"), CHECKS)
def test_an_alternative_is_read_after_the_text_before_it(line: str, before: str, alternative: str, shown: bool) -> None:
    checker = ContentFilter.from_lines([line]).alternatives()
    for part in (before[: len(before) // 2], before[len(before) // 2 :]):
        checker.extend(part)
    assert checker.allows(alternative) is shown


def test_an_alternative_that_holds_a_filtered_word_is_left_out(plain: TestClient, tmp_path: Path) -> None:
    before = complete(plain, return_token_ids=True)
    assert matching(WORD, shown_alternatives(before))  # the tiny model weighs it: the filter has work to do
    with filtered(tmp_path, WORD) as client:
        choice = complete(client, return_token_ids=True)
        assert choice["text"] == before["text"]  # the choice itself never held it
        assert not matching(WORD, shown_alternatives(choice))
        stream = streamed_logprobs(client)
        assert stream["tokens"] == choice["logprobs"]["tokens"]
        assert stream["top_logprobs"] == choice["logprobs"]["top_logprobs"]


def test_an_alternative_that_completes_a_match_after_the_text_before_it_is_left_out(
    plain: TestClient, tmp_path: Path
) -> None:
    before = complete(plain, return_token_ids=True)
    tokens, tops = before["logprobs"]["tokens"], before["logprobs"]["top_logprobs"]
    # at the prompt's third token, an alternative that the filter matches only with the token before it
    position = 3
    alternative = next(key for key in tops[position] if key not in ("", tokens[position]) and key.strip())
    pattern = regex.escape(tokens[position - 1] + alternative)
    assert not regex.search(pattern, before["text"]) and not regex.search(pattern, alternative)
    with filtered(tmp_path, "re:" + pattern) as client:
        choice = complete(client, return_token_ids=True)
        assert alternative not in choice["logprobs"]["top_logprobs"][position]
        decoded = [entry["decoded_token"] for entry in choice["prompt_logprobs"][position].values()]
        assert alternative not in decoded
        assert not matching(pattern, shown_alternatives(choice))
