from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.avx2_build import RUNS_HERE, avx2_library
from tokenmill.kernels import ops
from tokenmill.model.linear import (
    Int4Linear,
    Int8Linear,
    RowTiledLinear,
    TiledInt8Linear,
    float32_product,
    make_linear,
    quantize_int8,
    tile_int8,
)


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


@pytest.mark.parametrize(("n", "k"), [(512, 128), (2048, 640)])
def test_fp32_rows_do_not_depend_on_batch_size_at_model_widths(n: int, k: int) -> None:
    # at these widths MKL's row 0 of 8 (or 16) rows differed from row 0 of 4 on an Intel Xeon
    layer = make_linear(weight(n, k), "none")
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    alone = layer(x[:1])[0]
    for rows in (2, 5, 8, 9, 16, 17, 31, 40):
        batch = x[:rows].clone()
        batch[rows // 2] = x[0]
        assert torch.equal(layer(batch)[rows // 2], alone)


def test_row_tiled_linear_keeps_the_shape_of_any_input() -> None:
    layer = RowTiledLinear(weight())
    x = torch.randn(2, 3, 64)
    assert layer(x).shape == (2, 3, 96)
    assert torch.allclose(layer(x), F.linear(x, weight()), atol=1e-5)


tiled = pytest.mark.skipif(not ops.int8_matmul_available(), reason="no AVX-512 VNNI or no OpenMP: torch's kernel")


@tiled
@pytest.mark.parametrize(("n", "k", "rows"), [(96, 64, 1), (1000, 320, 7), (64, 32, 13), (130, 640, 16)])
def test_tiled_int8_is_the_product_with_the_dequantised_weights(n: int, k: int, rows: int) -> None:
    # k = 320 and 640 span several of the kernel's exact int32 chunks; n = 130 and 1000 end in a partial tile
    w = weight(n, k, torch.bfloat16)
    layer = TiledInt8Linear.quantize(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scale = quantize_int8(w)
    dequantised = q.double() * scale.double()[:, None]
    exact = x.double() @ dequantised.T
    got = layer(x).double()
    # int16 activations (half a step: at most 2^-15 of a row's largest) and bf16 rounding of the output (2^-8 relative)
    bound = 2.0**-8 * exact.abs() + k * 2.0**-15 * x.double().abs().amax(1, keepdim=True) * dequantised.abs().amax()
    assert (got - exact).abs().le(bound).all()


@tiled
def test_tiled_int8_is_exact_on_small_integers() -> None:
    # weights with a largest |w| of 127 per row quantise with scale 1; small integer activations are exact in int16
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (200, 96), generator=gen).float()
    w[:, 0] = 127.0
    x = torch.randint(-2, 3, (5, 96), generator=gen).float()
    layer = TiledInt8Linear.quantize(w.to(torch.bfloat16))
    assert torch.equal(layer(x.to(torch.bfloat16)), (x @ w.T).to(torch.bfloat16))


@tiled
def test_tiled_int8_rows_with_nan_or_inf_give_nan_and_leave_the_others_alone() -> None:
    layer = TiledInt8Linear.quantize(weight(96, 64, torch.bfloat16))
    x = torch.randn(4, 64).to(torch.bfloat16)
    x[1, 3], x[2, 7] = float("nan"), float("inf")
    x[3] = 0.0
    out = layer(x)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[0], layer(x[:1])[0]) and torch.equal(out[3], torch.zeros(96, dtype=torch.bfloat16))


@tiled
def test_tiled_and_plain_int8_embedding_rows_agree() -> None:
    w = weight(300, 64, torch.bfloat16)
    ids = torch.tensor([0, 63, 64, 299, 5])
    plain, tiles = Int8Linear.quantize(w, torch.bfloat16), TiledInt8Linear.quantize(w)
    assert torch.equal(tiles.dequantized_rows(ids).float().sign(), plain.dequantized_rows(ids).float().sign())
    assert torch.allclose(tiles.dequantized_rows(ids).float(), plain.dequantized_rows(ids).float(), rtol=2**-7, atol=0)


@tiled
def test_tiled_int8_float32_output_is_the_unrounded_bf16_output() -> None:
    layer = TiledInt8Linear.quantize(weight(130, 640, torch.bfloat16))
    x = torch.randn(9, 640).to(torch.bfloat16)
    full = layer(x, out_dtype=torch.float32)
    assert full.dtype == torch.float32 and torch.equal(full.to(torch.bfloat16), layer(x))
    assert not torch.equal(full, full.to(torch.bfloat16).float())  # really unrounded
    assert torch.equal(float32_product(layer, x), full)


def _exact_int8_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_matmul.c's arithmetic in torch: int16 rows with a power-of-two scale, exact integer sums over chunks of
    256 inputs, the chunks' sums added in float32 in order, then times (row scale × weight scale), in float32."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    _, exponent = torch.frexp(amax / 32767.0)
    row_scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.zeros_like(amax))
    inverse = torch.where(row_scale > 0, 1.0 / row_scale, torch.zeros_like(row_scale))
    qx = torch.round(xf * inverse[:, None]).long()
    total = torch.zeros(x.shape[0], q.shape[0])
    for lo in range(0, x.shape[1], 256):
        total = total + (qx[:, lo : lo + 256] @ q[:, lo : lo + 256].long().T).float()
    return total * (row_scale[:, None] * scale[None, :])


@tiled
def test_tiled_int8_computes_exactly_the_documented_arithmetic() -> None:
    w = weight(130, 640, torch.bfloat16)
    layer = TiledInt8Linear.quantize(w)
    q, scale = quantize_int8(w)
    x = (torch.randn(5, 640, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    expected = _exact_int8_product(x, q, scale)
    assert torch.equal(layer(x, out_dtype=torch.float32), expected)
    assert torch.equal(layer(x), expected.to(torch.bfloat16))


@pytest.mark.skipif(not RUNS_HERE, reason="the AVX2 build cannot run here")
def test_the_avx2_build_of_the_int8_matmul_gives_the_same_bits(tmp_path: Path) -> None:
    """The kernel has an AVX-512 and an AVX2 path; whichever this machine compiles natively, the AVX2 build must
    compute the documented arithmetic bit for bit (and so equal the AVX-512 path, tested above where it runs)."""
    lib = avx2_library(tmp_path, "int8_matmul")
    w = weight(130, 640, torch.bfloat16)
    q, scale = quantize_int8(w)
    tiles = tile_int8(q)
    for rows in (1, 7):
        x = (torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows)) * 4).to(torch.bfloat16)
        out = torch.empty(rows, 130)
        assert (
            lib.int8_matmul(x.data_ptr(), rows, 640, tiles.data_ptr(), scale.data_ptr(), 130, out.data_ptr(), 1, 2) == 0
        )
        assert torch.equal(out, _exact_int8_product(x, q, scale))
