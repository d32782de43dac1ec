"""Prompt scoring (echo + logprobs): the model's logprob of every prompt token given the tokens before it.

Full-vocabulary logits for a long prompt are large (512 tokens × 262k × 4 bytes = 537 MB), so they are computed a
slice of rows at a time and reduced at once to what the request asked for: the actual next token and the top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tokenmill.engine.outputs import TokenLogprob

ROWS_PER_SLICE = 64


class LogitsFn(Protocol):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def prompt_logprob_entries(
    runner: LogitsFn,
    hidden: torch.Tensor,  # (Q, H): hidden states of prompt positions start .. start + Q - 1
    token_ids: list[int],
    start: int,
    num_prompt_tokens: int,
    top_k: int,
    token_text: Callable[[int], str],
) -> list[TokenLogprob]:
    """Entries for the prompt tokens at positions start + 1 .. (each predicted by the row before it)."""
    num_rows = min(hidden.shape[0], num_prompt_tokens - 1 - start)  # the last prompt row predicts generated text
    entries: list[TokenLogprob] = []
    for lo in range(0, max(num_rows, 0), ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, num_rows)
        logprobs = torch.log_softmax(runner.logits(hidden[lo:hi]), dim=-1)  # (R, V)
        targets = torch.tensor(token_ids[start + lo + 1 : start + hi + 1])  # (R,)
        chosen_t = logprobs.gather(1, targets[:, None])  # (R, 1)
        ranks = (1 + (logprobs > chosen_t).sum(dim=-1)).tolist()
        chosen = chosen_t[:, 0].tolist()
        top_vals, top_ids = torch.topk(logprobs, top_k, dim=-1) if top_k else (None, None)
        for r, target in enumerate(targets.tolist()):
            top = []
            if top_ids is not None and top_vals is not None:
                top = [(t, token_text(t), v) for t, v in zip(top_ids[r].tolist(), top_vals[r].tolist())]
            entries.append(TokenLogprob(target, token_text(target), chosen[r], top, ranks[r]))
    return entries
