"""One step's sampling around the sampler: which logits rows to compute, which rows are unusable, the grammar masks
(one for each distinct grammar state), and a batch that fails row by row instead of as a whole.

sampler.py is the pure pipeline over a batch of logits; this module is what the core needs to feed it from the
model's hidden states while keeping a fault inside one row. It only reports (per-row results, rows at fault); the core
decides which requests fail.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.engine.sampler import Sampled, SampleInput, sample
from tokenmill.model.causal_lm import HeadSummary

if TYPE_CHECKING:
    from tokenmill.engine.guided import Guide
    from tokenmill.engine.sequence import Sequence

log = logging.getLogger(__name__)


class HeadFn(Protocol):
    def logits_summarised(
        self, hidden: torch.Tensor, keep: list[int] | None = None
    ) -> tuple[torch.Tensor, HeadSummary | None]: ...


def gather_logits(
    runner: HeadFn, hidden: torch.Tensor, rows: list[int], keep: list[int] | None = None
) -> tuple[torch.Tensor, HeadSummary | None]:
    """(N, V) logits for the hidden-state rows `rows`, one per entry, and what the head's own pass found in them
    (each row's argmax and finiteness) where it found it; each distinct row goes through the head once.

    Forked choices repeat their parent's row: the head runs on the distinct rows and the repeats are copies. `keep`
    (one row): it is greedy and its sampling reads only its argmax and these ids' logits (greedy_keep).
    """
    distinct = sorted(set(rows))
    first, last = distinct[0], distinct[-1]
    # a run of neighbouring rows (a decode step's usual rows) as a view, not an indexed copy
    picked = hidden[first : last + 1] if last - first + 1 == len(distinct) else hidden[distinct]
    logits, summary = runner.logits_summarised(picked, keep if len(rows) == 1 else None)  # (R, V)
    if rows != distinct:
        index = {r: i for i, r in enumerate(distinct)}
        where = [index[r] for r in rows]
        logits = logits[where]  # (N, V), a copy
        if summary is not None:
            summary = summary.picked(where)
    return logits, summary


def greedy_keep(row: SampleInput) -> list[int] | None:
    """What a lone row's sampling reads of its logits when that is only the argmax and a few ids (greedy, no
    logprobs, one choice, no mask or allowed list): those ids (its bias, bans and penalties touch them), sorted;
    else None, and the row needs all its logits."""
    p = row.params
    if not p.greedy or p.logprobs is not None or p.n > 1:
        return None
    touched = row.touched()
    return sorted(touched) if touched is not None else None


def guided_masks(seqs: Seq[Sequence]) -> list[torch.Tensor | None]:
    """Each sequence's grammar mask for this step (None: no grammar). A matcher's state is its grammar and the tokens
    it has taken, so sequences alike in both share one mask: a request's n choices right after their fork, and any
    that have generated the same tokens since. Each mask is a pass over the vocabulary, not worth repeating."""
    masks: dict[tuple[Guide, tuple[int, ...]], torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for seq in seqs:
        if seq.guided is None or seq.params.guide is None:
            out.append(None)
            continue
        state = (seq.params.guide, tuple(seq.token_ids[seq.num_prompt_tokens :]))
        mask = masks.get(state)
        if mask is None:
            mask = masks[state] = seq.guided.allowed()
        out.append(mask)
    return out


def non_finite_rows(logits: torch.Tensor, summary: HeadSummary | None = None) -> list[int]:
    """The rows of (N, V) logits holding a NaN or an infinity (as the head's pass found, where it did)."""
    if summary is not None:
        return [i for i, ok in enumerate(summary.finite) if not ok]
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
