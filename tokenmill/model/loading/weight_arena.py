"""Memory for a model's regrouped GGUF weights, in 2 MB pages where Linux gives them.

Why: a decode step streams every weight once, and in 4 KB pages that stream crosses a page, a TLB entry and often a
page walk, every 4 KB. On a 16-row step the default model's head ran a tenth faster from huge pages (the README's
Performance section has the measurements). Linux gives transparent huge pages to memory advised MADV_HUGEPAGE before
it is first written (THP "madvise", the common default), but only in whole, aligned 2 MB pages, and most of a small
model's tensors are smaller than that.

How: one arena per model load hands the tensors out side by side from large chunks, each advised as a whole before
the regrouping writes it; a tensor as large as a chunk gets an advised allocation of its own. A chunk is a plain torch
tensor (the views keep it alive), and the memory is never touched here: only what the regrouping writes becomes
resident, so the chunks' unused tails cost address space, not memory (at most one 2 MB page each).
"""

from __future__ import annotations

import torch

from tokenmill.model.loading.memory import advise_huge_pages

CHUNK_BYTES = 64 << 20  # past glibc's largest mmap threshold (32 MB): a fresh, never-touched mapping every time
ALIGN = 64  # each tensor on its own cache lines, as torch.empty places it


def advised_empty(nbytes: int) -> torch.Tensor:
    """An unwritten uint8 tensor of `nbytes` whose whole 2 MB pages are advised to be huge."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(t.data_ptr(), t.data_ptr() + nbytes)
    return t


class WeightArena:
    """Unwritten uint8 buffers for one model's weights, carved from huge-page-advised chunks."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        if nbytes >= self.chunk_bytes:
            return advised_empty(nbytes)
        size = -(-nbytes // ALIGN) * ALIGN
        if self._chunk is None or self._used + size > self._chunk.numel():
            self._chunk, self._used = advised_empty(self.chunk_bytes), 0
        out = self._chunk[self._used : self._used + nbytes]
        self._used += size
        return out
