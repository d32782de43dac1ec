"""vLLM's `use_beam_search` over HTTP on the real engine (tiny random model, byte tokenizer): the beams it returns are
what a beam search must return, streamed and not, and the fields it cannot honour are 400s naming them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import TINY_MODEL, assert_openai_error, parse_sse, tiny_engine
from tokenmill.api.app import create_app
from tokenmill.config import Config

PROMPT = "Beams over"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_engine(), Config())) as test_client:
        yield test_client


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    body = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 6, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def scored(client: TestClient, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """The tokens' own logprobs after the prompt, scored by echo (an independent computation)."""
    out = complete(client, prompt=prompt_ids + token_ids, echo=True, logprobs=0, max_tokens=0)
    return out["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids) :]


def test_one_beam_is_greedy(client: TestClient) -> None:
    greedy = complete(client, temperature=0, ignore_eos=True)["choices"][0]
    beam = complete(client, use_beam_search=True, temperature=0, ignore_eos=True)["choices"][0]
    assert beam["text"] == greedy["text"] and beam["finish_reason"] == "length"


def test_beams_are_distinct_ranked_and_scored_as_the_model_scores_them(client: TestClient) -> None:
    out = complete(client, use_beam_search=True, n=4, logprobs=2, return_token_ids=True, ignore_eos=True)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    sequences = [tuple(c["token_ids"]) for c in choices]
    assert len(set(sequences)) == 4 and all(len(s) == 6 for s in sequences)
    sums = []
    for choice in choices:
        logprobs = choice["logprobs"]["token_logprobs"]
        assert logprobs == pytest.approx(scored(client, choice["prompt_token_ids"], choice["token_ids"]), abs=1e-4)
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
        sums.append(sum(logprobs))
    assert sums == sorted(sums, reverse=True)  # equal lengths: ranked by cumulative logprob
    assert out["usage"]["completion_tokens"] == 24


def test_one_step_keeps_the_likeliest_tokens_in_order(client: TestClient) -> None:
    """One token of width 4: the 4 likeliest next tokens (vLLM's prompt_logprobs ranks them), best first."""
    out = complete(client, use_beam_search=True, n=4, max_tokens=1, logprobs=0, ignore_eos=True, return_token_ids=True)
    prompt_ids = out["choices"][0]["prompt_token_ids"]
    ranked = complete(client, prompt=[*prompt_ids, 0], prompt_logprobs=5, max_tokens=1)["choices"][0]
    after_prompt = ranked["prompt_logprobs"][-1]  # the alternatives for the position after the prompt
    likeliest = sorted((e["rank"], int(i), e["logprob"]) for i, e in after_prompt.items() if e["rank"] <= 4)
    got = [(c["token_ids"][0], c["logprobs"]["token_logprobs"][0]) for c in out["choices"]]
    assert [i for i, _ in got] == [i for _, i, _ in likeliest]
    assert [lp for _, lp in got] == pytest.approx([lp for _, _, lp in likeliest], abs=1e-4)


def test_best_of_widens_the_search_and_n_beams_come_back(client: TestClient) -> None:
    narrow = complete(client, use_beam_search=True, n=2, ignore_eos=True, logprobs=0)["choices"]
    wide = complete(client, use_beam_search=True, n=2, best_of=6, ignore_eos=True, logprobs=0)["choices"]
    assert len(narrow) == len(wide) == 2

    def total(choice: dict[str, Any]) -> float:
        return sum(choice["logprobs"]["token_logprobs"])

    assert total(wide[0]) >= total(narrow[0]) - 1e-4  # a wider search never does worse at its best here


def test_length_penalty_ranks_by_mean_or_by_sum(client: TestClient) -> None:
    """A beam that ends at EOS early competes with longer ones by its score: cumulative / length ** penalty."""
    for penalty in (0.0, 1.0, 2.0):
        out = complete(client, use_beam_search=True, n=3, length_penalty=penalty, logprobs=0, max_tokens=8)
        scores = []
        for choice in out["choices"]:
            logprobs = choice["logprobs"]["token_logprobs"]
            scores.append(sum(logprobs) / max(len(logprobs), 1) ** penalty)  # an end token counts, as in transformers
        assert scores == sorted(scores, reverse=True)


def test_stream_gives_the_same_beams(client: TestClient) -> None:
    fields = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 5, "use_beam_search": True, "n": 3}
    whole = client.post("/v1/completions", json=fields).json()
    events = parse_sse(client.post("/v1/completions", json={**fields, "stream": True}).text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]


def test_stop_strings_end_a_beam(client: TestClient) -> None:
    free = complete(client, use_beam_search=True, n=2, ignore_eos=True)["choices"]
    stop = free[0]["text"][2:4]
    assert stop
    out = complete(client, use_beam_search=True, n=2, ignore_eos=True, stop=[stop])["choices"]
    assert all(stop not in c["text"] for c in out)
    assert any(c["finish_reason"] == "stop" and c["stop_reason"] == stop for c in out)


def test_echo_with_no_tokens_returns_the_prompt_scored(client: TestClient) -> None:
    out = complete(client, use_beam_search=True, n=2, echo=True, logprobs=0, max_tokens=0)
    plain = complete(client, echo=True, logprobs=0, max_tokens=0)
    assert [c["text"] for c in out["choices"]] == [PROMPT, PROMPT]
    assert out["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]


def test_the_search_leaves_no_blocks_behind(client: TestClient) -> None:
    complete(client, use_beam_search=True, n=4, max_tokens=8)
    stats = client.get("/stats").json()
    assert stats["num_running"] == 0 and stats["num_used_blocks"] == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {"70": 5}}, "logit_bias"),
        ({"allowed_token_ids": [70]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"length_penalty": 50.0}, "length_penalty"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400(client: TestClient, fields: dict[str, Any], param: str) -> None:
    body = {"model": TINY_MODEL, "prompt": PROMPT, "use_beam_search": True, "n": 2, **fields}
    assert assert_openai_error(client.post("/v1/completions", json=body), 400)["param"] == param


def test_length_penalty_needs_beam_search(client: TestClient) -> None:
    body = {"model": TINY_MODEL, "prompt": PROMPT, "length_penalty": 1.5}
    assert assert_openai_error(client.post("/v1/completions", json=body), 400)["param"] == "length_penalty"
