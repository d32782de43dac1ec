"""`use_beam_search` against `transformers`' own beam search on the same weights (float32): the same beams, in the same
order, with Hugging Face's defaults for what a beam search leaves open (length_penalty 1, no early_stopping)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.server import MODEL, Reference, Server

NEWLINE = 107  # Gemma's "\n": as a stop token id, beams end at different lengths, which length_penalty weighs
CASES = [("The capital of France is", []), ("def fibonacci(n):\n", []), ("def fibonacci(n):\n", [NEWLINE])]
WIDTH, MAX_TOKENS = 4, 12


def hf_beams(
    reference: Reference, ids: list[int], width: int, length_penalty: float, stop_ids: list[int]
) -> list[list[int]]:
    eos = [*reference.weights.tokenizer.eos_ids, *stop_ids]  # the tokens the server ends at
    with torch.no_grad():
        out = reference.model.generate(
            torch.tensor([ids]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            early_stopping=False,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=0,
        )
    beams = []
    for row in out[:, len(ids) :].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        beams.append(row if end is None else row[: end + 1])  # up to its EOS; what follows is padding
    return beams


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize(("prompt", "stop_ids"), CASES)
def test_beams_equal_transformers(
    server: Server, reference: Reference, prompt: str, stop_ids: list[int], length_penalty: float
) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        n=WIDTH,
        extra_body={
            "use_beam_search": True,
            "length_penalty": length_penalty,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": stop_ids,
        },
    )
    ids = out.choices[0].model_extra["prompt_token_ids"]
    served = [choice.model_extra["token_ids"] for choice in out.choices]
    expected = hf_beams(reference, ids, WIDTH, length_penalty, stop_ids)
    print(f"{prompt!r} penalty {length_penalty}: served {served}, transformers {expected}")
    assert served == expected
