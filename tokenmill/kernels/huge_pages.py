"""Memory for a model's weights, which every decode step streams, in transparent huge pages.

Why: a decode step reads every weight once. In 4 KiB pages each 4 KiB read needs an address translation of its own,
and the translations of a few hundred megabytes do not stay cached; on a virtual machine a missed one walks two page
tables, the guest's and the host's. In 2 MiB pages a step needs 512 times fewer, and weights left untouched for a few
seconds (a server between requests) read as fast as before. The KV cache stays in small pages: a huge page is backed
whole at its first write, which on some machines costs a request that first writes a new stretch of the cache more
than the reads gain (docs/decisions/0049-huge-pages-for-weights.md has the measurements).

How: an anonymous mapping aligned to 2 MiB and advised MADV_HUGEPAGE before anything touches it, so that Linux backs
each 2 MiB touched with one huge page where transparent huge pages are on for advised memory (its `madvise` and
`always` settings, the usual defaults). Elsewhere (another OS, huge pages off, the advice refused) the same memory
comes in ordinary pages: slower, never wrong. Pages are backed when first written, as torch.empty's are.

An Arena carves many tensors out of a few such mappings (a model's weights are hundreds of tensors, most far smaller
than 2 MiB, and each would otherwise hold a huge page of its own); `empty` maps one of its own.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each arena tensor starts on a cache line, as torch.empty's do
ARENA_CHUNK = 64 << 20  # bytes an arena maps at a time (a larger tensor gets a mapping of its own)


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` unwritten bytes (uint8) in memory advised for huge pages, freed when the last view of it is."""
    return _mapping(nbytes)[:nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """A 2 MiB-aligned anonymous mapping of at least `nbytes` (whole huge pages), advised for huge pages."""
    size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    try:
        mapped = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):  # no anonymous mappings here: ordinary memory
        return torch.empty(size, dtype=torch.uint8)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping open as long as a view of it lives
    skip = -whole.data_ptr() % HUGE_PAGE
    advise = getattr(mapped, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            advise(mmap.MADV_HUGEPAGE, skip, size)
        except OSError:  # a kernel without transparent huge pages: the mapping still works in small pages
            pass
    return whole[skip : skip + size]


class Arena:
    """Tensors carved from huge-page mappings of ARENA_CHUNK bytes, each on a cache line; a tensor larger than a
    chunk gets a mapping of its own. A mapping is freed when the last tensor carved from it is."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._at = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """`nbytes` unwritten bytes (uint8) from the current chunk, or a new one."""
        if nbytes > self.chunk_bytes:
            return empty(nbytes)
        if self._at + nbytes > self._chunk.numel():
            self._chunk, self._at = _mapping(self.chunk_bytes), 0
        out = self._chunk[self._at : self._at + nbytes]
        self._at += -(-nbytes // ALIGN) * ALIGN
        return out
