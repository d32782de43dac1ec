"""The arena that places a model's regrouped GGUF weights in huge-page-advised chunks (weight_arena.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.model.gguf_blocks import activations, weights
from tokenmill.kernels import ops
from tokenmill.model.gguf_linear import GgufLinear, GgufWeight, Regrouping
from tokenmill.model.loading.memory import HUGE_PAGE, advise_huge_pages
from tokenmill.model.loading.weight_arena import WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_small_tensors_lie_side_by_side_on_their_own_cache_lines() -> None:
    arena = WeightArena(chunk_bytes=1 << 20)
    a, b, c = arena.empty(100), arena.empty(1000), arena.empty(64)
    assert [t.numel() for t in (a, b, c)] == [100, 1000, 64]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert b.data_ptr() - a.data_ptr() == 128 and c.data_ptr() - b.data_ptr() == 1024  # 64-byte aligned, no overlap
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c))


def test_a_full_chunk_starts_another_and_a_chunk_sized_tensor_gets_its_own() -> None:
    arena = WeightArena(chunk_bytes=4096)
    first, second = arena.empty(3000), arena.empty(3000)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    big = arena.empty(4096)
    assert big.untyped_storage().nbytes() == 4096 and big.untyped_storage().data_ptr() not in (
        first.untyped_storage().data_ptr(),
        second.untyped_storage().data_ptr(),
    )


def test_no_advice_where_no_whole_huge_page_fits() -> None:
    assert not advise_huge_pages(HUGE_PAGE + 1, 3 * HUGE_PAGE - 1)  # straddles two pages, holds neither
    assert not advise_huge_pages(0, 4096)


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(ch in "0123456789abcdef-" for ch in head):
            begin, end = (int(x, 16) for x in head.split("-"))
            inside = begin <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no transparent huge pages"
)
def test_an_advised_chunk_is_backed_by_huge_pages_once_written() -> None:
    arena = WeightArena()
    t = arena.empty(8 * HUGE_PAGE)
    t.fill_(1)  # first written after the advice, as the regrouping writes the weights
    assert _anon_huge_kb(t.data_ptr() + 4 * HUGE_PAGE) >= 2048


@pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
def test_layers_regrouped_into_an_arena_compute_what_their_own_buffers_do() -> None:
    regrouping = Regrouping(WeightArena(chunk_bytes=1 << 20))
    kinds = (T.Q5_0, T.Q8_0, T.Q6_K)
    parts = [weights(t, seed=i) for i, t in enumerate(kinds)]
    layers = [GgufLinear([GgufWeight(int(t), raw, k)], regrouping) for (raw, k), t in zip(parts, kinds)]
    regrouping.run()
    storages = {packed.untyped_storage().data_ptr() for layer in layers for _, packed, _, _ in layer.kernel_parts()}
    assert len(storages) == 1  # one chunk holds them all
    for layer, (raw, k), t in zip(layers, parts, kinds):
        x = activations(3, k).to(torch.bfloat16)
        assert torch.equal(layer(x), GgufLinear([GgufWeight(int(t), raw, k)])(x))
