"""The real model through the official `openai` client and raw SSE."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server import MODEL, Reference, Server

PROMPT = "The capital of France is"


def test_greedy_completion_matches_the_reference_text(server: Server, reference: Reference) -> None:
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    tokenizer = reference.weights.tokenizer
    ids = tokenizer.encode(PROMPT)
    expected = reference.greedy(ids, 12)  # transformers, fp32, on the weights the (fp32) server runs
    assert len(ids) == 6 and len(expected) == 12
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 6
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.system_fingerprint


def test_every_prompt_form_gives_the_same_greedy_text(server: Server) -> None:
    client = server.client()
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    forms = [PROMPT, [PROMPT], ids, [ids]]
    texts = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text for p in forms
    ]
    assert len(set(texts)) == 1, texts


def test_stream_joined_equals_non_stream(server: Server) -> None:
    client = server.client()
    kw = {"model": MODEL, "prompt": ["Once upon a time", "def fib(n):"], "max_tokens": 20, "temperature": 0, "n": 2}
    full = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    joined: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert {c.index: c.text for c in full.choices} == joined
    assert all(len(v) == 1 for v in finishes.values()) and len(finishes) == 4
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing_ends_with_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in r.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames)
    payloads = [json.loads(f[6:]) for f in frames[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_is_never_returned(server: Server) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = "France"
    assert stop in plain
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == plain[: plain.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop], stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_echo_scoring_is_consistent_with_generation_logprobs(server: Server) -> None:
    client = server.client()
    gen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    text = gen.choices[0].text
    lp = gen.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    scored = client.completions.create(model=MODEL, prompt=PROMPT + text, max_tokens=0, echo=True, logprobs=0)
    slp = scored.choices[0].logprobs
    assert slp is not None and slp.token_logprobs is not None and slp.tokens is not None
    assert scored.choices[0].text == PROMPT + text
    assert slp.token_logprobs[0] is None
    tail = slp.token_logprobs[-len(lp.token_logprobs) :]
    for a, b in zip(tail, lp.token_logprobs):
        assert a is not None and b is not None and math.isclose(a, b, abs_tol=2e-3)


def test_seed_makes_sampling_reproducible(server: Server) -> None:
    client = server.client()
    kw = {"model": MODEL, "prompt": "A short poem:", "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    a = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    b = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    c = client.completions.create(**{**kw, "seed": 99}).choices[0].text  # type: ignore[call-overload]
    assert a == b
    assert a != c


def test_sixteen_concurrent_clients_share_batches(server: Server) -> None:
    before = server.stats()
    prompts = [f"Item {i}: the best thing about the number {i} is" for i in range(16)]

    def one(prompt: str) -> str:
        r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, prompts, timeout=300))
    after = server.stats()
    assert all(texts)
    assert after["steps_with_multiple_seqs"] > before["steps_with_multiple_seqs"]
    assert after["max_seqs_in_step"] > 1
    assert after["num_used_blocks"] == 0 and after["num_running"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 40000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: Server, body: dict[str, object], status: int, param: str
) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
