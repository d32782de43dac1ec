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
comes in ordinary pages: slower, never wrong; where Linux says transparent huge pages are `never`, the first mapping
logs a warning once, with the setting to change. Pages are backed when first written, as torch.empty's are.

An Arena carves many tensors out of a few such mappings (a model's weights are hundreds of tensors, most far smaller
than 2 MiB, and each would otherwise hold a huge page of its own); `empty` maps one of its own.

Backed ahead: where a host backs a virtual machine's memory only as it is first written, a fresh huge page's first
write costs milliseconds, and a gigabyte of weights adds a second to a start. `back_ahead`, which a start calls
before its imports (they hold the GIL for over a second on one core), maps the region a model's weights will take
and has the kernel back it on a thread of its own (MADV_POPULATE_WRITE; no GIL held); the next Arena takes it as its
first chunk and, once the weights are written, hands back what it did not use (`trim`). Nothing here imports torch
before a tensor is asked for.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each arena tensor starts on a cache line, as torch.empty's do
ARENA_CHUNK = 64 << 20  # bytes an arena maps at a time (a larger tensor gets a mapping of its own)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the one in brackets
_checked: set[Path] = set()  # the settings files already read: the warning is logged once a process


def thp_setting(path: Path = THP_SETTING) -> str | None:
    """Linux's transparent huge page setting ("always", "madvise" or "never"); None where there is no such file."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


def warn_if_off(path: Path = THP_SETTING) -> None:
    """Log once that the weights will be in small pages, where Linux has transparent huge pages turned off."""
    if path in _checked:
        return
    _checked.add(path)
    if thp_setting(path) == "never":
        log.warning(
            "transparent huge pages are off (%s says never): the model's weights are held in small pages, which "
            "decode reads slower on many machines; `echo madvise > %s` (as root) turns them on for the memory that "
            "asks for them",
            path,
            path,
        )


MADV_POPULATE_WRITE = 23  # Linux 5.14's: back a range as writes would, in one call


@dataclass
class _Region:
    """Whole huge pages within an anonymous mapping: [skip, skip + size) of `mapped`, starting on a 2 MiB boundary."""

    mapped: mmap.mmap
    skip: int
    size: int
    address: int  # where the region starts (the mapping's address plus skip)
    advised: bool  # MADV_HUGEPAGE taken: false where the kernel has no transparent huge pages

    def tensor(self) -> torch.Tensor:
        """The region as uint8 bytes; each view holds the mapping open as long as it lives."""
        import torch

        return torch.frombuffer(self.mapped, dtype=torch.uint8)[self.skip : self.skip + self.size]


def _whole_pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole huge pages, at least one."""
    return max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)


def _map(nbytes: int) -> _Region | None:
    """At least `nbytes` (whole huge pages) of a fresh anonymous mapping, aligned to 2 MiB and advised for huge pages
    before anything touches them; None where there are no anonymous mappings."""
    size = _whole_pages(nbytes)
    try:
        mapped = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):
        return None
    warn_if_off()
    view = ctypes.c_char.from_buffer(mapped)
    start = ctypes.addressof(view)
    del view  # the address stays valid as long as the mapping: only the export ends
    skip = -start % HUGE_PAGE
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE, skip, size)
        advised = True
    except (OSError, AttributeError):  # no such advice here: the mapping still works, in small pages
        advised = False
    return _Region(mapped, skip, size, start + skip, advised)


@dataclass
class _Ahead:
    """A region being backed ahead of the load that will carve it."""

    region: _Region
    thread: threading.Thread


_ahead: list[_Ahead] = []  # backed ahead, in the order the loads will ask (back_ahead), taken by each new Arena


def back_ahead(nbytes: int) -> None:
    """Map `nbytes` (whole huge pages) advised for huge pages and back them on a thread of its own, for the next Arena
    to take as its first chunk; without anonymous mappings or the advice, nothing."""
    region = _map(nbytes)
    if region is None or not region.advised:
        return

    def populate() -> None:  # a failed call (an older kernel) leaves the pages to their first writes
        ctypes.CDLL(None).madvise(ctypes.c_void_p(region.address), ctypes.c_size_t(region.size), MADV_POPULATE_WRITE)

    thread = threading.Thread(target=populate, name="huge-pages-ahead", daemon=True)
    thread.start()
    _ahead.append(_Ahead(region, thread))


def drop_ahead() -> None:
    """Hand back what was backed ahead and no load took (a model that kept its weights otherwise)."""
    while _ahead:
        _ahead.pop().thread.join()


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` unwritten bytes (uint8) in memory advised for huge pages, freed when the last view of it is."""
    return _mapping(nbytes)[:nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """A 2 MiB-aligned mapping of at least `nbytes` (whole huge pages) as a tensor; ordinary memory where there are
    no anonymous mappings."""
    region = _map(nbytes)
    if region is None:
        import torch

        return torch.empty(_whole_pages(nbytes), dtype=torch.uint8)
    return region.tensor()


class Arena:
    """Tensors carved from huge-page mappings of ARENA_CHUNK bytes, each on a cache line; a tensor larger than a
    chunk gets a mapping of its own. A mapping is freed when the last tensor carved from it is."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK) -> None:
        import torch

        self.chunk_bytes = chunk_bytes
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._at = 0
        self._ahead: _Ahead | None = _ahead.pop(0) if _ahead else None  # backed ahead for this arena: its first chunk
        if self._ahead is not None:
            self._ahead.thread.join()
            self._chunk = self._ahead.region.tensor()

    def empty(self, nbytes: int) -> torch.Tensor:
        """`nbytes` unwritten bytes (uint8) from the current chunk, or a new one."""
        if self._at + nbytes <= self._chunk.numel():
            return self._carve(nbytes)
        if nbytes > self.chunk_bytes:
            return empty(nbytes)
        self.trim()
        self._chunk, self._at = _mapping(self.chunk_bytes), 0
        return self._carve(nbytes)

    def _carve(self, nbytes: int) -> torch.Tensor:
        out = self._chunk[self._at : self._at + nbytes]
        self._at += -(-nbytes // ALIGN) * ALIGN
        return out

    def trim(self) -> None:
        """Hand back the huge pages of the chunk backed ahead past what was carved from it (MADV_DONTNEED)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        region = ahead.region
        used = -(-self._at // HUGE_PAGE) * HUGE_PAGE  # the current chunk is still that one: trim runs before a new
        if used < region.size:
            region.mapped.madvise(mmap.MADV_DONTNEED, region.skip + used, region.size - used)
