"""SamplingParams: everything the engine needs to know about how one request samples and stops.

The API layer resolves user value → server default → OpenAI default before building this; the engine never sees
`None` meaning "not sent".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Tokens that end the sequence besides the model's EOS (a filled-in middle's end tokens), finish_reason "stop".
    stop_token_ids: tuple[int, ...] = ()
    # Top-k alternatives to report for each generated token; None: no logprobs wanted (the chosen token's logprob is
    # still tracked, it ranks best_of candidates).
    logprobs: int | None = None
    # Top-k alternatives for each prompt token (echo + logprobs); None: prompt logprobs are not computed at all.
    prompt_logprobs: int | None = None
    # Number of sequences forked from the one prefilled prompt (n, or best_of when it is larger).
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
