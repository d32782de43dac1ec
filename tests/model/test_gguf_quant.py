from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.model.gguf_blocks import TYPES, N, activations, random_blocks, weights, width
from tokenmill.model.gguf_quant import (
    SUPPORTED,
    dequantize,
    dequantize_rows,
    gguf_matmul,
    quantize_activations,
    row_bytes,
)


def test_supported_types() -> None:
    assert SUPPORTED == frozenset({2, 6, 8, 12, 13, 14})


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_row_bytes_match_the_file_layout(t: T) -> None:
    raw, k = weights(t, n=3)
    assert row_bytes(t, k) == raw.shape[1]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    assert row_bytes(t, 4 * block) == 4 * type_size
    with pytest.raises(ValueError):
        row_bytes(t, block + 1)


def test_row_bytes_rejects_an_unsupported_type() -> None:
    with pytest.raises(ValueError):
        row_bytes(int(T.Q2_K), 256)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_bit_for_bit(t: T) -> None:
    raw, k = weights(t)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), t))
    out = dequantize(raw, t, k)
    assert out.dtype == torch.float32 and out.shape == (N, k)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_on_arbitrary_bytes(t: T) -> None:
    raw = random_blocks(t, 8, width(t), seed=2)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), t))
    assert torch.equal(dequantize(raw, t, width(t)), ref)


def test_dequantize_rows_picks_rows() -> None:
    raw, k = weights(T.Q4_K)
    ids = torch.tensor([[5, 0], [47, 5]])
    rows = dequantize_rows(raw, T.Q4_K, k, ids)
    assert rows.shape == (2, 2, k)
    assert torch.equal(rows, dequantize(raw, T.Q4_K, k)[ids])


def test_activation_codes_approximate_the_input() -> None:
    x = activations(5, 128) * 3
    q, d = quantize_activations(x.bfloat16())
    assert q.dtype == torch.int8 and q.shape == (5, 128)
    assert d.dtype == torch.float32 and d.shape == (5, 4)
    assert int(q.abs().max()) == 127  # the largest element of each block maps to +-127
    recon = q.float().view(5, 4, 32) * d.unsqueeze(-1)
    assert torch.all((recon - x.bfloat16().float().view(5, 4, 32)).abs() <= d.unsqueeze(-1) / 2 * 1.0001)


def test_activation_arithmetic_is_the_specified_float32() -> None:
    x = activations(64, 256, seed=3)
    q, d = quantize_activations(x)
    xb = x.numpy().reshape(64, 8, 32)
    amax = np.abs(xb).max(axis=-1)
    inv = np.float32(127.0) / amax
    assert np.array_equal(d.numpy(), amax / np.float32(127.0))
    assert np.array_equal(q.numpy().reshape(64, 8, 32), np.clip(np.rint(xb * inv[..., None]), -127, 127))


def test_zero_and_non_finite_blocks() -> None:
    x = activations(3, 96)
    x[0, 32:64] = 0.0
    x[1, 70] = float("nan")
    x[2, 5] = float("-inf")
    q, d = quantize_activations(x)
    assert d[0, 1] == 0 and torch.all(q[0, 32:64] == 0)
    assert torch.isnan(d[1, 2]) and torch.all(q[1, 64:96] == 0)
    assert torch.isnan(d[2, 0]) and torch.all(q[2, 0:32] == 0)
    others = torch.ones_like(d, dtype=torch.bool)
    others[0, 1] = others[1, 2] = others[2, 0] = False
    assert torch.all(d[others] > 0) and torch.all(torch.isfinite(d[others]))


def test_rounding_is_half_to_even() -> None:
    # amax = 127 gives the reciprocal 1.0 exactly, so x * (127 / amax) = x: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -0.5 -> 0.
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5])
    q, d = quantize_activations(x)
    assert d[0, 0] == 1.0
    assert q[0, :5].tolist() == [127, 2, 4, -2, 0]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_approximates_the_dequantized_product(t: T) -> None:
    raw, k = weights(t)
    x = activations(7, k)
    ref = x @ dequantize(raw, t, k).T
    out = gguf_matmul(x, raw, t, k)
    assert out.dtype == torch.float32 and out.shape == (7, N)
    # int8 per 32 of normal activations alone costs ~0.7% of the norm
    assert torch.linalg.norm(out - ref) < 1.5e-2 * torch.linalg.norm(ref)
    # Against the quantised activations the product is exact up to float32 rounding: the integer sums, scales and
    # mins are all applied right.
    q, d = quantize_activations(x)
    exact = (q.double().view(7, -1, 32) * d.double().unsqueeze(-1)).view(7, k) @ dequantize(raw, t, k).double().T
    assert torch.linalg.norm(out.double() - exact) < 1e-6 * torch.linalg.norm(exact)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_rows_do_not_depend_on_the_batch(t: T) -> None:
    raw, k = weights(t)
    x = activations(40, k) * torch.logspace(-2, 2, 40).unsqueeze(1)  # rows of very different magnitudes
    for m in (1, 2, 3, 5, 8, 13, 17, 31, 37, 40):
        full = gguf_matmul(x[:m], raw, t, k)
        for i in range(m):
            assert torch.equal(gguf_matmul(x[i : i + 1], raw, t, k), full[i : i + 1]), (m, i)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_a_nan_row_stays_in_its_row(t: T) -> None:
    raw, k = weights(t)
    x = activations(5, k)
    x[2, 3] = float("nan")
    out = gguf_matmul(x, raw, t, k)
    assert torch.all(torch.isnan(out[2]))
    for i in (0, 1, 3, 4):
        assert torch.equal(out[i : i + 1], gguf_matmul(x[i : i + 1], raw, t, k))
        assert torch.all(torch.isfinite(out[i]))


def test_bad_shapes_are_rejected() -> None:
    raw, k = weights(T.Q8_0, n=2)
    with pytest.raises(ValueError):
        dequantize(raw[:, :-1], T.Q8_0, k)
    with pytest.raises(ValueError):
        gguf_matmul(activations(1, k + 32), raw, T.Q8_0, k)
    with pytest.raises(ValueError):
        quantize_activations(torch.zeros(2, 33))
