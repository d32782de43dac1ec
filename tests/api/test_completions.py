from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.api_helpers import MODEL, body, parse_sse
from tests.api.fake_engine import SCRIPT, CharTokenizer, FakeEngine, scripted_text, token_logprob
from tokenmill.api import choice as choice_module
from tokenmill.api.app import create_app
from tokenmill.api.logprobs import MIN_LOGPROB, LogprobsBuilder
from tokenmill.config import Config

TOK = CharTokenizer()
FULL = len(SCRIPT) + 1  # every script character, then EOS


def complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json=body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


def test_response_envelope(client: TestClient) -> None:
    out = complete(client)
    assert out["id"].startswith("cmpl-") and len(out["id"]) > 10
    assert out["object"] == "text_completion"
    assert isinstance(out["created"], int)
    assert (out["model"], out["system_fingerprint"]) == (MODEL, "fp_fake")
    assert out["choices"] == [
        {"text": SCRIPT[:16], "index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 16,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


PROMPT_FORMS: list[tuple[Any, list[list[int]]]] = [
    ("ab", [TOK.encode("ab")]),
    (["ab", "c"], [TOK.encode("ab"), TOK.encode("c")]),
    (TOK.encode("ab"), [TOK.encode("ab")]),
    # token ids without the BOS this tokenizer starts every text with: read as sent, as OpenAI and vLLM read them
    (TOK.encode("ab", add_special_tokens=False), [TOK.encode("ab", add_special_tokens=False)]),
    ([TOK.encode("ab"), [7]], [TOK.encode("ab"), [7]]),
    ("", [[TOK.bos_id]]),
    (None, [[TOK.bos_id]]),
]


@pytest.mark.parametrize(("prompt", "engine_ids"), PROMPT_FORMS)
def test_every_prompt_form(client: TestClient, engine: FakeEngine, prompt: Any, engine_ids: list[list[int]]) -> None:
    out = complete(client, prompt=prompt, max_tokens=5)
    assert [ids for _, ids, _ in engine.requests] == engine_ids  # strings get BOS; token ids go in verbatim
    assert [c["text"] for c in out["choices"]] == [SCRIPT[:5]] * len(engine_ids)
    assert out["usage"]["prompt_tokens"] == sum(len(ids) for ids in engine_ids)


def test_choices_are_prompt_major_with_n(client: TestClient, engine: FakeEngine) -> None:
    out = complete(client, prompt=["a", "b"], n=3, max_tokens=4)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [scripted_text(j)[:4] for j in range(3)] * 2
    assert [params.n for _, _, params in engine.requests] == [3, 3]  # one engine request per prompt, forked n ways
    assert out["usage"]["prompt_tokens"] == 4  # each prompt counted once, not n times
    assert out["usage"]["completion_tokens"] == 24


def test_finish_reasons(client: TestClient) -> None:
    out = complete(client, prompt=["a", "b"], n=2, max_tokens=100)
    assert out["choices"] == [  # prompt-major: prompt i's choice j has index 2i + j and writes script j in full
        {"text": scripted_text(j), "index": index, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        for index, j in enumerate([0, 1, 0, 1])
    ]
    stopped = complete(client, max_tokens=100, stop=["fox", "dog"])["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == ("The quick brown ", "stop")
    assert complete(client, max_tokens=3)["choices"][0]["finish_reason"] == "length"


def test_max_tokens_zero_with_echo_returns_the_prompt(client: TestClient) -> None:
    out = complete(client, prompt="Hello", max_tokens=0, echo=True)
    assert out["choices"][0]["text"] == "Hello"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0


def test_add_bos_to_token_prompts_puts_bos_before_ids_without_it(engine: FakeEngine) -> None:
    """--add-bos-to-token-prompts: the model reads a BOS the client did not send; echo and its logprobs show only the
    ids sent (lm-evaluation-harness's remote tokenizer sends ids without BOS)."""
    bare = TOK.encode("Hi", add_special_tokens=False)
    with TestClient(create_app(engine, Config(add_bos_to_token_prompts=True))) as client:
        out = complete(client, prompt=[bare, TOK.encode("Hi")], echo=True, logprobs=0, max_tokens=0)
        assert [ids for _, ids, _ in engine.requests] == [TOK.encode("Hi"), TOK.encode("Hi")]
        first, second = out["choices"]
        assert first["text"] == "Hi" and first["logprobs"]["tokens"] == ["H", "i"]
        assert first["logprobs"]["token_logprobs"] == [-2.0, -2.0]  # the unseen BOS gave "H" its context
        assert second["text"] == "<bos>Hi" and second["logprobs"]["tokens"] == ["<bos>", "H", "i"]
        assert out["usage"]["prompt_tokens"] == 6  # what the model read


def test_token_prompt_without_bos_is_scored_as_sent(client: TestClient, engine: FakeEngine) -> None:
    """By default the first id sent has no context: its logprob is null, as OpenAI's and vLLM's are."""
    bare = TOK.encode("Hi", add_special_tokens=False)
    choice = complete(client, prompt=bare, echo=True, logprobs=0, max_tokens=0, return_token_ids=True)["choices"][0]
    assert [ids for _, ids, _ in engine.requests] == [bare]
    assert choice["prompt_token_ids"] == bare
    assert choice["text"] == "Hi" and choice["logprobs"]["token_logprobs"] == [None, -2.0]


def test_echo_prepends_the_prompt(client: TestClient) -> None:
    out = complete(client, prompt=["Hi ", "Yo "], echo=True, max_tokens=3, n=2)
    texts = [c["text"] for c in out["choices"]]
    assert texts == ["Hi The", "Hi he ", "Yo The", "Yo he "]


def test_echo_of_token_ids_decodes_them(client: TestClient) -> None:
    out = complete(client, prompt=TOK.encode("Hi"), echo=True, max_tokens=2)
    assert out["choices"][0]["text"] == "<bos>HiTh"


def assert_logprobs_consistent(choice: dict[str, Any], k: int, prompt: str = "") -> None:
    """`prompt`: the prompt's text when it is not echoed (offsets then count from its start, as OpenAI's do)."""
    lp = choice["logprobs"]
    choice = {**choice, "text": prompt + choice["text"]}
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len({len(v) for v in lp.values()}) == 1
    for top in lp["top_logprobs"]:
        assert top is None or 1 <= len(top) <= k + 1
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert offset <= len(choice["text"])
        assert token == "" or token.startswith("<") or choice["text"].startswith(token, offset)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_logprobs_shape_and_top_bound(client: TestClient, k: int) -> None:
    choice = complete(client, logprobs=k, max_tokens=6)["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == list(SCRIPT[:6])
    assert lp["token_logprobs"] == [token_logprob(0)] * 6
    assert lp["text_offset"] == list(range(2, 8))  # OpenAI's: from the prompt's start ("hi"), even without echo
    expected_keys = {0: {"T"}, 1: {"A", "T"}, 2: {"A", "T"}, 5: {"A", "B", "C", "D", "T"}}[k]
    assert all(set(top) == expected_keys for top in lp["top_logprobs"][:1])
    assert_logprobs_consistent(choice, k, prompt="hi")


def test_top_logprobs_keep_the_best_logprob_per_text(client: TestClient) -> None:
    top = complete(client, logprobs=5, max_tokens=1)["choices"][0]["logprobs"]["top_logprobs"][0]
    chosen = token_logprob(0)
    assert top == {"A": chosen + 0.5, "T": chosen, "B": chosen - 1.5, "C": chosen - 2.5, "D": chosen - 3.5}
    assert list(top.values()) == sorted(top.values(), reverse=True)


def test_echo_logprobs_for_scoring(client: TestClient) -> None:
    out = complete(client, prompt="Hi", echo=True, logprobs=1, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == "Hi"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["", "H", "i"]  # the BOS the tokenizer added is not in the text: "" and no room
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"] == [None, -2.0, -2.0]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"A": -1.5, "H": -2.0}
    assert lp["text_offset"] == [0, 0, 1]  # the BOS the tokenizer added is not in the text: it takes no room
    assert_logprobs_consistent(choice, 1)


def test_echo_logprobs_then_generated_tokens(client: TestClient) -> None:
    choice = complete(client, prompt=TOK.encode("Hi"), echo=True, logprobs=0, max_tokens=3)["choices"][0]
    assert choice["text"] == "<bos>HiThe"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<bos>", "H", "i", "T", "h", "e"]
    assert lp["token_logprobs"] == [None, -2.0, -2.0, -1.0, -1.0, -1.0]
    assert lp["text_offset"] == [0, 5, 6, 7, 8, 9]
    assert_logprobs_consistent(choice, 0)


def test_non_finite_logprobs_never_reach_json() -> None:
    engine = FakeEngine(neg_inf_alternative=True)
    with TestClient(create_app(engine, Config())) as client:
        response = client.post("/v1/completions", json=body(logprobs=5, max_tokens=2))
    assert "Infinity" not in response.text and "NaN" not in response.text
    top = json.loads(response.text)["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top["Z"] == MIN_LOGPROB


def test_best_of_returns_the_highest_mean_logprob(client: TestClient, engine: FakeEngine) -> None:
    out = complete(client, best_of=3, max_tokens=5)
    assert engine.requests[0][2].n == 3
    assert out["choices"] == [
        {"text": scripted_text(2)[:5], "index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert out["usage"]["completion_tokens"] == 15  # all three candidates count


def test_best_of_with_n_reindexes_per_prompt(client: TestClient) -> None:
    out = complete(client, prompt=["a", "b"], best_of=3, n=2, max_tokens=4, logprobs=0)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [scripted_text(2)[:4], scripted_text(1)[:4]] * 2
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [token_logprob(2)] * 4
    assert out["usage"]["completion_tokens"] == 2 * 3 * 4


def test_usage_counts_cached_tokens() -> None:
    engine = FakeEngine(cached_tokens=2)
    with TestClient(create_app(engine, Config())) as client:
        out = client.post("/v1/completions", json=body(prompt=["abc", "d"], n=2, max_tokens=100)).json()
    assert out["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4 * FULL,
        "total_tokens": 6 + 4 * FULL,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@pytest.mark.parametrize(("max_tokens", "finish_reason", "chars"), [(0, "length", 0), (4, "stop", 3)])
def test_finish_reason_is_inferred_when_the_engine_sends_no_final_delta(
    max_tokens: int, finish_reason: str, chars: int
) -> None:
    engine = FakeEngine(omit_final_deltas=True)  # the dropped final delta also held the last token
    with TestClient(create_app(engine, Config())) as client:
        out = client.post("/v1/completions", json=body(max_tokens=max_tokens, n=2, echo=True)).json()
    assert [c["finish_reason"] for c in out["choices"]] == [finish_reason] * 2
    assert [c["text"] for c in out["choices"]] == ["hi" + scripted_text(j)[:chars] for j in range(2)]


@pytest.mark.parametrize(
    "engine",
    [FakeEngine(error_at_step=2), FakeEngine(raise_at_step=2), FakeEngine(abort_at_step=2)],
    ids=["error-output", "exception", "abort"],
)
def test_engine_failure_is_a_500_and_the_server_keeps_serving(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, Config()), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json=body())
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").status_code == 200


def test_sampling_params_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    complete(client, temperature=0, top_p=0.5, seed=3, stop="z", logit_bias={"9": -100}, logprobs=2, echo=True)
    params = engine.requests[0][2]
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.0, 0.5, 3, ("z",))
    assert (params.logit_bias, params.logprobs, params.prompt_logprobs) == ({9: -100.0}, 2, 2)


def test_a_prompts_logprobs_are_worked_out_once_for_all_its_choices(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n choices of one prompt carry the same echo logprobs and prompt_logprobs: made once per prompt, not per choice
    (n × a long prompt's alternatives is the work and memory a request could multiply)."""
    calls: Counter[str] = Counter()
    real_prompt, real_vllm = LogprobsBuilder.prompt, choice_module.vllm_prompt_logprobs

    def counted_prompt(self: LogprobsBuilder, *args: Any, **kwargs: Any) -> Any:
        calls["echo"] += 1
        return real_prompt(self, *args, **kwargs)

    def counted_vllm(*args: Any, **kwargs: Any) -> Any:
        calls["prompt_logprobs"] += 1
        return real_vllm(*args, **kwargs)

    monkeypatch.setattr(LogprobsBuilder, "prompt", counted_prompt)
    monkeypatch.setattr(choice_module, "vllm_prompt_logprobs", counted_vllm)
    fields = {"echo": True, "logprobs": 2, "prompt_logprobs": 3, "max_tokens": 2, "n": 4}
    out = complete(client, prompt=["Hi", "Yo"], **fields)
    assert calls == {"echo": 2, "prompt_logprobs": 2}
    first, *others = out["choices"][:4]
    for choice in others:
        assert choice["prompt_logprobs"] == first["prompt_logprobs"]
        assert choice["logprobs"]["tokens"][:3] == first["logprobs"]["tokens"][:3]
    streamed = parse_sse(client.post("/v1/completions", json=body(prompt="Hi", stream=True, **fields)).text)
    echoed = [c for event in streamed[:-1] for c in event["choices"] if "prompt_logprobs" in c]
    assert len(echoed) == 4 and all(c["prompt_logprobs"] == first["prompt_logprobs"] for c in echoed)
