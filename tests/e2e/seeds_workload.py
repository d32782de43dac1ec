"""The requests of the seeds-under-load check, shared by tests/e2e/test_seeds_under_load.py (over HTTP) and
scripts/batch_invariance.py (in-process): a seeded sampling request, a greedy one, and each round's fillers, as the
bodies of OpenAI completion requests."""

from __future__ import annotations

import random
from typing import Any

SEEDED = {"prompt": "Write a short poem about the sea:", "max_tokens": 24, "temperature": 1.0, "seed": 1234}
GREEDY = {"prompt": "The history of the printing press begins", "max_tokens": 24, "temperature": 0}
FILLER_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "small", "cat", "watches"]


def fillers(round_index: int) -> list[dict[str, Any]]:
    """14 requests of different prompt and output lengths, some seeded, some greedy, some unseeded."""
    rng = random.Random(round_index)
    out = []
    for i in range(14):
        words = rng.choices(FILLER_WORDS, k=rng.randint(1, 60))
        out.append(
            {
                "prompt": f"{i}: " + " ".join(words),
                "max_tokens": rng.randint(1, 32),
                "temperature": rng.choice([0, 0.7, 1.0]),
                **({"seed": rng.randint(0, 99)} if i % 2 else {}),
            }
        )
    return out
