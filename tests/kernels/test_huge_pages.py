"""Memory advised for transparent huge pages (kernels/huge_pages.py): what it holds, where it lies, how it is carved."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch

from tests.memory_maps import linux_only, rss_kib, vm_flags
from tokenmill.kernels import huge_pages
from tokenmill.model.gguf_linear import Regrouping


def test_empty_holds_its_bytes_from_a_huge_page_boundary() -> None:
    buffer = huge_pages.empty(3 * huge_pages.HUGE_PAGE + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * huge_pages.HUGE_PAGE + 5
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0
    buffer.fill_(7)
    buffer[-1] = 9
    assert int(buffer[:-1].to(torch.int64).sum()) == 7 * (buffer.numel() - 1) and int(buffer[-1]) == 9


@linux_only
def test_empty_is_advised_for_huge_pages() -> None:
    buffer = huge_pages.empty(huge_pages.HUGE_PAGE)
    buffer.zero_()
    assert "hg" in vm_flags(buffer.data_ptr())  # MADV_HUGEPAGE: the kernel backs it with huge pages where it can


@linux_only
def test_a_models_regrouped_weights_lie_in_advised_memory() -> None:
    regrouping = Regrouping()
    weights = regrouping.empty(8, 4096, 1024)  # a Q8_0 tensor's buffer, as GgufLinear asks for it
    weights.zero_()
    assert "hg" in vm_flags(weights.data_ptr())
    assert "hg" not in vm_flags(torch.empty(4 << 20, dtype=torch.uint8).zero_().data_ptr())  # torch.empty's are not


def test_an_arenas_tensors_are_apart_and_each_on_a_cache_line() -> None:
    arena = huge_pages.Arena(chunk_bytes=4096)
    sizes = [100, 64, 1, 1000, 3000, 5000, 7]  # 3000 starts a second chunk; 5000 is past a chunk, a mapping its own
    tensors = [arena.empty(n) for n in sizes]
    assert [t.numel() for t in tensors] == sizes
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [set(t.tolist()) for t in tensors] == [{i + 1} for i in range(len(sizes))]


def test_a_tensor_keeps_its_mapping_after_the_arena_is_gone() -> None:
    arena = huge_pages.Arena(chunk_bytes=1 << 20)
    kept = arena.empty(1000)
    del arena
    kept.fill_(3)
    assert int(kept.to(torch.int64).sum()) == 3000


@pytest.mark.parametrize(
    ("setting", "read", "warned"),
    [
        ("always [madvise] never", "madvise", False),
        ("[always] madvise never", "always", False),
        ("always madvise [never]", "never", True),
    ],
)
def test_huge_pages_turned_off_are_said_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    setting: str,
    read: str,
    warned: bool,
) -> None:
    monkeypatch.setattr(huge_pages, "_checked", set())
    path = tmp_path / "enabled"
    path.write_text(setting + "\n")
    assert huge_pages.thp_setting(path) == read
    with caplog.at_level(logging.WARNING, logger=huge_pages.__name__):
        huge_pages.warn_if_off(path)
        huge_pages.warn_if_off(path)
    said = [r.getMessage() for r in caplog.records if "transparent huge pages are off" in r.getMessage()]
    assert len(said) == (1 if warned else 0)
    assert not warned or f"echo madvise > {path}" in said[0]


def test_a_system_without_the_setting_reads_as_unknown(tmp_path: Path) -> None:
    assert huge_pages.thp_setting(tmp_path / "missing") is None


@linux_only
def test_pages_backed_ahead_become_the_next_arenas_and_what_it_leaves_goes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(huge_pages, "_ahead", [])
    huge_pages.back_ahead(8 * huge_pages.HUGE_PAGE)
    arena = huge_pages.Arena()
    assert huge_pages._ahead == []  # taken
    first = arena.empty(1000)
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0 and "hg" in vm_flags(first.data_ptr())
    backed = rss_kib(first.data_ptr())
    if backed < 8 * huge_pages.HUGE_PAGE // 1024:
        pytest.skip("this kernel does not back memory ahead (MADV_POPULATE_WRITE)")
    second = arena.empty(huge_pages.HUGE_PAGE)  # into the second huge page
    assert second.data_ptr() == first.data_ptr() + 1024
    arena.trim()
    assert rss_kib(first.data_ptr()) <= 2 * huge_pages.HUGE_PAGE // 1024  # two pages carved from, six handed back
    first.fill_(1)
    second.fill_(2)
    assert int(first.to(torch.int64).sum()) == 1000 and int(second[-1]) == 2


def test_pages_backed_ahead_and_never_taken_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "_ahead", [])
    huge_pages.back_ahead(huge_pages.HUGE_PAGE)
    huge_pages.drop_ahead()
    assert huge_pages._ahead == []
    assert huge_pages.Arena().empty(10).data_ptr() != 0  # an arena without them maps its own


def test_without_anonymous_mappings_the_memory_is_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise OSError("no anonymous mappings here")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refused)
    monkeypatch.setattr(huge_pages, "_ahead", [])
    buffer = huge_pages.empty(3000)
    buffer.fill_(5)
    assert buffer.numel() == 3000 and int(buffer.to(torch.int64).sum()) == 15000
    huge_pages.back_ahead(huge_pages.HUGE_PAGE)
    assert huge_pages._ahead == []  # nothing to back


def test_memory_the_kernel_will_not_advise_is_used_but_not_backed_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(huge_pages.mmap, "MADV_HUGEPAGE")
    monkeypatch.setattr(huge_pages, "_ahead", [])
    huge_pages.back_ahead(huge_pages.HUGE_PAGE)
    assert huge_pages._ahead == []
    buffer = huge_pages.empty(huge_pages.HUGE_PAGE + 1)
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0
    buffer.fill_(1)
    assert int(buffer.to(torch.int64).sum()) == huge_pages.HUGE_PAGE + 1


def test_a_regions_address_is_where_its_tensor_starts_on_a_huge_page_boundary() -> None:
    region = huge_pages._map(3 * huge_pages.HUGE_PAGE + 1)
    assert region is not None and region.size == 4 * huge_pages.HUGE_PAGE
    assert region.address % huge_pages.HUGE_PAGE == 0 and region.tensor().data_ptr() == region.address
