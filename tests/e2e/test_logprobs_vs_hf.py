"""Numbers you can trust: the server's logprobs equal `transformers`' on the same weights (fp32), to 1e-3.

Echo scoring over a few hundred tokens of varied text (prose, code, numbers, CJK, emoji, past nothing but BOS), and
greedy generation with logprobs, where transformers' own greedy `generate` must pick the same tokens.
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from tests.e2e.server import MODEL, Reference, Server

TOLERANCE = 1e-3
TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its cafés.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Invoice #20931 — 3 × 12.50 EUR = 37.50 EUR; VAT 19% (7.13 EUR); total: 44.63 EUR, due 2024-07-31.",
    "日本語の文章と中文句子，还有한국어 문장。Emoji: 🎉🚀👩‍👩‍👧 and café, naïve, Straße.",
    '{"name": "tokenmill", "version": [0, 1, 0], "tags": ["llm", "server"], "ok": true, "ratio": 0.25}',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories every night.",
    "SELECT name, COUNT(*) AS n FROM users WHERE created_at > '2023-01-01' GROUP BY name ORDER BY n DESC LIMIT 10;",
]
GENERATION_PROMPTS = ["The capital of France is", "def quicksort(items):", "Q: Why is the sky blue?\nA:"]
GENERATED_TOKENS = 40


def log_softmax(reference: Reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference.model(torch.tensor([ids])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits, dim=-1)


def complete(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scoring_logprobs_equal_transformers(server: Server, reference: Reference) -> None:
    tokenizer = reference.weights.tokenizer
    scored, worst = 0, 0.0
    for text in TEXTS:
        ids = tokenizer.encode(text)
        served_ids = httpx.post(server.base_url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
        assert served_ids == ids
        lp = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=5)["choices"][0]["logprobs"]
        expected = log_softmax(reference, ids)  # (T, V); row t predicts token t + 1
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
        for t in range(1, len(ids)):
            want = expected[t - 1]
            worst = max(worst, abs(lp["token_logprobs"][t] - want[ids[t]].item()))
            worst = max(worst, abs(max(lp["top_logprobs"][t].values()) - want.max().item()))  # the argmax's logprob
        scored += len(ids) - 1
    print(f"echo: {scored} tokens scored, max |Δ logprob| vs transformers {worst:.2e}")
    assert scored >= 250
    assert worst <= TOLERANCE


def test_greedy_generation_and_its_logprobs_equal_transformers(server: Server, reference: Reference) -> None:
    tokenizer = reference.weights.tokenizer
    worst = 0.0
    for prompt in GENERATION_PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = reference.model.generate(
                torch.tensor([ids]),
                max_new_tokens=GENERATED_TOKENS,
                min_new_tokens=GENERATED_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        hf_ids = out.sequences[0, len(ids) :].tolist()
        hf_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, hf_ids)]

        body = {
            "prompt": ids,
            "max_tokens": GENERATED_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "logit_bias": {str(i): -100 for i in tokenizer.eos_ids},
        }  # as min_new_tokens: no early EOS
        choice = complete(server, **body)["choices"][0]
        assert choice["text"] == tokenizer.decode(hf_ids, skip_special_tokens=True), prompt
        served = choice["logprobs"]["token_logprobs"]
        assert len(served) == GENERATED_TOKENS
        worst = max([worst, *(abs(a - b) for a, b in zip(served, hf_logprobs))])
    print(f"generation: {len(GENERATION_PROMPTS) * GENERATED_TOKENS} tokens, max |Δ logprob| {worst:.2e}")
    assert worst <= TOLERANCE
