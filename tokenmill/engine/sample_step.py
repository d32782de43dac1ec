"""One step's sampling around the sampler: which logits rows to compute, which rows are unusable, and a batch that
fails row by row instead of as a whole.

sampler.py is the pure pipeline over a batch of logits; this module is what the core needs to feed it from the
model's hidden states while keeping a fault inside one row. It only reports (per-row results, rows at fault); the core
decides which requests fail.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.engine.prompt_logprobs import LogitsFn
from tokenmill.engine.sampler import Sampled, SampleInput, sample

log = logging.getLogger(__name__)


def gather_logits(runner: LogitsFn, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """(N, V) logits for the hidden-state rows `rows`, one per entry; each distinct row goes through the head once.

    Forked choices repeat their parent's row: the head runs on the distinct rows and the repeats are copies.
    """
    distinct = sorted(set(rows))
    logits = runner.logits(hidden[distinct])  # (R, V)
    if rows != distinct:
        where = {r: i for i, r in enumerate(distinct)}
        logits = logits[[where[r] for r in rows]]  # (N, V), a copy
    return logits


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of (N, V) logits holding a NaN or an infinity."""
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()  # (N,): one pass; a NaN or inf anywhere spoils the sum
    return [i for i, ok in enumerate(finite) if not ok]


def sample_rows(logits: torch.Tensor, inputs: list[SampleInput]) -> list[Sampled | Exception]:
    """The batch at once; if that fails, row by row, so only the row at fault gets an exception instead of a token."""
    try:
        return list(sample(logits, inputs))
    except Exception:
        log.exception("batched sampling failed; sampling row by row")
    results: list[Sampled | Exception] = []
    for i, row in enumerate(inputs):
        try:
            results.extend(sample(logits[i : i + 1], [row]))
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which fails that row's request
            results.append(exc)
    return results
