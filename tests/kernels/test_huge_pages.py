"""Memory advised for transparent huge pages (kernels/huge_pages.py): what it holds, where it lies, how it is carved."""

from __future__ import annotations

import itertools

import torch

from tests.memory_maps import linux_only, vm_flags
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
