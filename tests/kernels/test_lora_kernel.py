"""lora.c's low-rank updates against model/lora.py's torch path, and each row's result independent of the others."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.lora_updates import packed
from tokenmill.kernels import ops

pytestmark = pytest.mark.skipif(ops.library() is None, reason="no C compiler: the torch path is the only path")
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("widths", "k", "ranks"), [([1024, 256, 256], 640, [16, 16, 16]), ([640], 1030, [8]), ([37], 20, [3])]
)
def test_the_c_update_equals_the_torch_path(widths: list[int], k: int, ranks: list[int]) -> None:
    wrapper, update = packed(widths, k, ranks)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)).to(BF16)
    y = torch.randn(9, wrapper.out_features, generator=torch.Generator().manual_seed(2)).to(BF16)
    rows = [0, 2, 3, 7]
    expected, got = y.clone(), y.clone()
    update.add_in_torch(expected, x, torch.tensor(rows))
    ops.lora_update_rows(update.c, rows, x, got)
    others = [r for r in range(9) if r not in rows]
    assert torch.equal(got[others], y[others])  # rows outside the group untouched
    # float32 sums in another order, one rounding to bf16: at most one step of bf16 apart
    assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2**-7 + 1e-6).all()
    assert (got[rows] != y[rows]).float().mean() > 0.9


def test_a_rows_update_does_not_depend_on_its_neighbours() -> None:
    _, update = packed([1024, 256, 256], 640, [16, 16, 16])
    x = torch.randn(16, 640, generator=torch.Generator().manual_seed(3)).to(BF16)
    y = torch.randn(16, 1536, generator=torch.Generator().manual_seed(4)).to(BF16)
    together = y.clone()
    ops.lora_update_rows(update.c, list(range(16)), x, together)
    for r in (0, 5, 15):
        alone = y.clone()
        ops.lora_update_rows(update.c, [r], x, alone)
        assert torch.equal(alone[r], together[r])
