"""What one completion request may ask for: prompts, sequences, prompt tokens and running time, each a clear 400.

The cheap checks (counts) run before any tokenisation; the token total runs once the prompts are tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.api.errors import invalid_request
from tokenmill.config import Config


@dataclass(frozen=True)
class RequestLimits:
    max_prompts: int = 2048
    max_choices: int = 4096  # prompts × max(n, best_of): the sequences one request makes the engine run
    max_prompt_tokens: int = 1 << 20
    timeout_s: float | None = None

    @classmethod
    def from_config(cls, config: Config) -> RequestLimits:
        return cls(
            max_prompts=config.max_prompts_per_request,
            max_choices=config.max_choices_per_request,
            max_prompt_tokens=config.max_prompt_tokens_per_request,
            timeout_s=config.request_timeout_s or None,
        )

    def check_counts(self, num_prompts: int, num_candidates: int) -> None:
        if num_prompts > self.max_prompts:
            raise invalid_request(
                f"Too many prompts: {num_prompts} in one request; this server takes at most {self.max_prompts}.",
                "prompt",
            )
        if num_prompts * num_candidates > self.max_choices:
            raise invalid_request(
                f"Too many sequences: {num_prompts} prompt(s) × {num_candidates} (n or best_of) = "
                f"{num_prompts * num_candidates}; this server generates at most {self.max_choices} per request.",
                "n",
            )

    def check_prompt_tokens(self, lengths: Sequence[int]) -> None:
        total = sum(lengths)
        if total > self.max_prompt_tokens:
            raise invalid_request(
                f"Too many prompt tokens: {total} in one request; this server takes at most {self.max_prompt_tokens}.",
                "prompt",
            )
