from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.linear import Int4Linear, Int8Linear, RowTiledLinear, make_linear


def weight(n: int = 96, k: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)


@pytest.mark.parametrize(("cls", "tol"), [(Int8Linear, 0.02), (Int4Linear, 0.15)])
def test_quantised_layers_approximate_the_dense_product(cls: type, tol: float) -> None:
    w = weight(dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    out = cls.quantize(w, torch.bfloat16)(x).float()
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < tol * ref.abs().max()


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_row_results_do_not_depend_on_batch_size(quantization: str) -> None:
    dtype = torch.float32 if quantization == "none" else torch.bfloat16
    layer = make_linear(weight(dtype=dtype), quantization)
    x = torch.randn(12, 64, dtype=dtype)
    alone = layer(x[:1])[0]
    for rows in range(2, 13):
        for position in range(rows):  # a partial tile at the end must not compute its rows differently
            batch = x[:rows].clone()
            batch[position] = x[0]
            assert torch.equal(layer(batch)[position], alone)


def test_row_tiled_linear_keeps_the_shape_of_any_input() -> None:
    layer = RowTiledLinear(weight())
    x = torch.randn(2, 3, 64)
    assert layer(x).shape == (2, 3, 96)
    assert torch.allclose(layer(x), F.linear(x, weight()), atol=1e-5)
