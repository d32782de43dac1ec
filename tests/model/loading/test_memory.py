"""Handing memory back to the OS after loading (memory.py): a file mapping's read pages dropped from the process but
not from the file, and glibc's freed heap trimmed."""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.model.loading import memory

PAGE = mmap.PAGESIZE
PAGES = 16
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self (Linux)")


def resident_bytes(address: int) -> int:
    """What of the mapping holding `address` is resident in this process (/proc/self/smaps's Rss)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: start-end perms offset ...
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "Rss:":
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def process_resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[mmap.mmap, int, bytes]]:
    """A file of PAGES pages, each a different byte, mapped privately (as the loader maps a model file); the mapping,
    its address and the file's bytes."""
    content = b"".join(bytes([i + 1]) * PAGE for i in range(PAGES))
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # an exported buffer would keep the mapping from closing
    yield mapping, address, content
    mapping.close()


def read_all(mapping: mmap.mmap) -> bytes:
    return mapping[:]


def test_the_pages_read_leave_the_process_and_come_back_from_the_file(mapped: tuple[mmap.mmap, int, bytes]) -> None:
    mapping, address, content = mapped
    assert read_all(mapping) == content
    assert resident_bytes(address) == PAGES * PAGE
    memory.unmap_file_pages(address, address + PAGES * PAGE)
    assert resident_bytes(address) == 0
    assert read_all(mapping) == content  # faulted back in from the file, unchanged
    assert resident_bytes(address) == PAGES * PAGE


def test_only_the_pages_of_the_range_go_the_first_from_its_start(mapped: tuple[mmap.mmap, int, bytes]) -> None:
    """A tensor need not start on a page: the page it starts in goes too; the pages past its end stay."""
    mapping, address, content = mapped
    read_all(mapping)
    memory.unmap_file_pages(address + 100, address + 6 * PAGE)
    assert resident_bytes(address) == (PAGES - 6) * PAGE
    assert read_all(mapping) == content


def test_the_freed_heap_goes_back_to_the_os() -> None:
    """Freed blocks in the middle of the heap stay resident until trimmed: the block above them holds the heap's top,
    so free() alone cannot shrink it."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc: nothing to trim")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 1024  # below glibc's mmap threshold: heap blocks, 64 MiB in all
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks[:-1]:
        libc.free(block)
    try:
        before = process_resident_bytes()
        memory.release_freed_memory()
        assert before - process_resident_bytes() > count * size // 2
    finally:
        libc.free(blocks[-1])


def test_without_libc_s_calls_both_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a C library without malloc_trim or madvise (or none that ctypes can open) loading goes on as it is."""

    class NoLibc:
        def __init__(self, name: object) -> None:
            raise OSError("no C library here")

    monkeypatch.setattr(memory.ctypes, "CDLL", NoLibc)
    memory.release_freed_memory()
    memory.unmap_file_pages(0, PAGE)

    class Bare:
        def __init__(self, name: object) -> None:
            pass

    monkeypatch.setattr(memory.ctypes, "CDLL", Bare)  # opens, but has neither function: AttributeError
    memory.release_freed_memory()
    memory.unmap_file_pages(0, PAGE)
