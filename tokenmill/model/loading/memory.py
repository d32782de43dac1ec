"""Giving freed heap memory back to the operating system (glibc), so the process's RSS shows what it really holds;
and backing the huge pages a GGUF model's weights will take ahead of its load."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

from tokenmill.kernels import huge_pages


def release_freed_memory() -> None:
    """Loading parses JSON and replaces full-precision weights by quantised ones; glibc keeps the freed heap mapped
    (and counted in RSS) until asked to trim it. Elsewhere this does nothing: later allocations reuse the memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


MADV_DONTNEED = 4  # Linux's value (mmap.MADV_DONTNEED), for libc's madvise through ctypes


def unmap_file_pages(begin: int, end: int) -> None:
    """Drop the pages of [begin, end) — a private, never-written mapping of a file — from this process (madvise
    DONTNEED): they stay in the page cache and fault back in on the next read. Loading reads a GGUF's blocks once
    to regroup them; without this, those read-once pages would count in RSS next to their regrouped copy.

    Only for a file mapping no one wrote to: on anonymous or written memory DONTNEED discards the contents."""
    start = begin - begin % mmap.PAGESIZE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def back_weights_ahead(gguf: Path) -> None:
    """Begin backing the huge pages a GGUF model's regrouped weights will take (kernels/huge_pages.back_ahead): about
    the file's size (a head's 6-bit copy gets pages of its own; what the weights do not take goes back after them)."""
    huge_pages.back_ahead(gguf.stat().st_size)


def drop_weights_ahead() -> None:
    """Hand back pages backed ahead that no load took."""
    huge_pages.drop_ahead()
