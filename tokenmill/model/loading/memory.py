"""Giving freed heap memory back to the operating system (glibc), so the process's RSS shows what it really holds."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Loading parses JSON and replaces full-precision weights by quantised ones; glibc keeps the freed heap mapped
    (and counted in RSS) until asked to trim it. Elsewhere this does nothing: later allocations reuse the memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
