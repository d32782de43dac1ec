"""The fused bfloat16 kernels (tokenmill/kernels/fused.c) against the torch ops they replace, and batch invariance."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import build, ops
from tokenmill.model.layers import RMSNorm, Rotary, apply_rotary, gelu_mul, norm_rotary, silu_mul

pytestmark = pytest.mark.skipif(ops.library() is None, reason="no C compiler: the torch path is the only path")
BF16 = torch.bfloat16
EPS = 1e-6


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, EPS, offset=1.0)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(9)).to(BF16)
    return norm


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place (same-sign values)."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def test_rms_norm_equals_torch_and_its_residual_add_too() -> None:
    x, y, norm = _randn(7, 640, scale=30.0), _randn(7, 640, seed=1, scale=5.0), _norm(640)
    torch_path = F.rms_norm(x.float(), (640,), norm.factor, EPS).to(BF16)
    assert _ulps(ops.rms_norm(x, norm.factor, EPS), torch_path) <= 1
    expected = y + F.rms_norm(x.float(), (640,), norm.factor, EPS).to(BF16)
    assert _ulps(ops.add_rms_norm(y, x, norm.factor, EPS), expected) <= 1


def test_llamas_weighted_norm_equals_hugging_faces_arithmetic() -> None:
    x = _randn(7, 2048, seed=2, scale=30.0)
    weight = _randn(2048, seed=3)
    expected = weight * F.rms_norm(x.float(), (2048,), None, EPS).to(BF16)  # LlamaRMSNorm in bf16: two roundings
    got = ops.weighted_rms_norm(x, weight.float(), EPS)
    assert _ulps(got, expected) <= 1 and (got != expected).float().mean() < 0.02  # a reduction order apart at most
    norm = RMSNorm(2048, EPS)  # the module takes the kernel in bf16
    norm.weight.data = weight
    assert torch.equal(norm(x), got)


def test_rotary_is_torchs_on_strided_heads() -> None:
    t, heads, d = 5, 6, 64
    qkv = _randn(t, (heads + 2) * d, seed=8, scale=4.0)
    x = qkv[:, : heads * d].view(t, heads, d)  # rows strided, as sliced from the q/k/v projection
    cos, signed_sin = Rotary(d, 500_000.0)(torch.arange(1000, 1000 + t), BF16)
    expected = torch.addcmul(x * cos, torch.roll(x, d // 2, dims=-1), signed_sin)  # apply_rotary's torch ops
    assert torch.equal(ops.rotary(x, cos[:, 0], signed_sin[:, 0]), expected)
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)


@pytest.mark.skipif(not ops.silu_mul_available(), reason="no AVX-512, AVX2 or OpenMP: torch's ops")
def test_gated_silu_kernel_matches_the_formula_on_strided_rows() -> None:
    f = 2048
    wide = _randn(7, 2 * f + 64, seed=13, scale=6.0)
    gate_up = wide[:, : 2 * f]
    got = ops.silu_mul(gate_up).double()
    g, up = gate_up[:, :f].double(), gate_up[:, f:].double()
    expected = (g / (1 + torch.exp(-g))).to(BF16).double() * up  # torch's bf16 intermediate, then the product
    assert (got - expected).abs().le(2.0**-7 * expected.abs() + 1e-30).all()
    torch_path = F.silu(gate_up[:, :f]) * gate_up[:, f:]
    assert (silu_mul(gate_up) != torch_path).float().mean() < 0.01  # torch's own exp: rare last-bit differences
    assert torch.equal(ops.silu_mul(gate_up[2:3])[0], ops.silu_mul(gate_up)[2])  # rows independent


def test_norm_rotary_equals_norm_then_rotary_on_strided_heads() -> None:
    t, heads, d = 5, 5, 256
    qkv = _randn(t, (heads + 1) * d, scale=4.0)
    x = qkv[:, : heads * d].view(t, heads, d)  # rows strided, as sliced from the q/k/v projection
    factor = torch.rand(heads, d, generator=torch.Generator().manual_seed(3)) + 0.5
    cos, signed_sin = Rotary(d, 10_000.0)(torch.arange(100, 100 + t), BF16)
    normed = (F.rms_norm(x.float(), (d,), None, EPS) * factor).to(BF16)
    expected = apply_rotary(normed, cos, signed_sin)
    got = ops.norm_rotary(x, factor, cos[:, 0], signed_sin[:, 0], EPS)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert (got != expected).float().mean() < 0.02  # rounding points identical: only rare last-bit ties differ


def test_rows_do_not_depend_on_the_batch() -> None:
    x, norm = _randn(9, 640, seed=4, scale=10.0), _norm(640)
    gate_up = _randn(9, 512, seed=5)
    cos, signed_sin = Rotary(64, 10_000.0)(torch.arange(9), BF16)
    heads = _randn(9, 3, 64, seed=6)
    factor = torch.ones(3, 64)
    whole = (norm(x), norm.add_to(x, x), gelu_mul(gate_up), norm_rotary(heads, factor, EPS, cos, signed_sin))
    for i in (0, 4, 8):
        alone = (
            norm(x[i : i + 1]),
            norm.add_to(x[i : i + 1], x[i : i + 1]),
            gelu_mul(gate_up[i : i + 1]),
            norm_rotary(heads[i : i + 1], factor, EPS, cos[i : i + 1], signed_sin[i : i + 1]),
        )
        for a, w in zip(alone, whole):
            assert torch.equal(a[0], w[i])


def test_without_a_compiler_the_torch_path_computes_the_same_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    x, norm = _randn(3, 640, seed=7, scale=10.0), _norm(640)
    with_kernels = (norm(x), gelu_mul(torch.cat([x, x], dim=-1)))
    monkeypatch.setattr(ops, "library", lambda: None)
    without = (norm(x), gelu_mul(torch.cat([x, x], dim=-1)))
    assert _ulps(with_kernels[0], without[0]) <= 1
    torch.testing.assert_close(with_kernels[1].float(), without[1].float(), rtol=1e-2, atol=1e-2)


def test_a_compiler_without_openmp_builds_the_norms_and_leaves_the_threaded_kernels_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = build.Compiler.find()
    assert compiler is not None
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {compiler.command} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(build, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        lib = build.library(tmp_path / "kernels")
        assert build.library(tmp_path / "kernels") is not None  # the cached serial build, no second warning
    assert lib is not None
    assert [path.name.endswith("-serial.so") for path in (tmp_path / "kernels").iterdir()] == [True]
    (warning,) = [record for record in caplog.records if record.name == build.__name__]
    message = warning.getMessage()
    assert "no OpenMP" in message and "docs/decisions/0002-no-prebuilt-kernels.md" in message and "set CC" in message
    available = [lib.int8_matmul_available(), lib.paged_attention_available(), lib.argmax_available()]
    assert available + [lib.gelu_mul_available()] == [0, 0, 0, 0]
    x, norm = _randn(3, 640, seed=8, scale=10.0), _norm(640)
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), 640, norm.factor.data_ptr(), out.data_ptr(), 3, 640, EPS)  # built without OpenMP too
    assert _ulps(out, F.rms_norm(x.float(), (640,), norm.factor, EPS).to(BF16)) <= 1
    scratch = torch.full((3, 64), 7.0)
    tiles, scale = torch.zeros(1, 320, 64, 2, dtype=torch.int8), torch.ones(64)
    status = lib.int8_matmul(x.data_ptr(), 3, 640, tiles.data_ptr(), scale.data_ptr(), 64, scratch.data_ptr(), 1, 1)
    assert status == -1 and torch.equal(scratch, torch.full((3, 64), 7.0))  # the stub refuses, writes nothing


@pytest.mark.skipif(not ops.argmax_available(), reason="no AVX-512, AVX2 or OpenMP: torch.argmax")
def test_argmax_rows_is_torch_argmax_with_ties_nans_and_infinities() -> None:
    n = 3 * 32768 + 7  # several segments and a ragged tail
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(11))
    x[1, 5] = x[1, 40000] = x[1, 70000] = 50.0  # ties across segments: the first wins
    x[2, n - 1] = 60.0  # the very last element
    x[3, 100] = x[3, 90000] = float("nan")  # NaN counts as the largest: the first NaN
    x[3, 7] = float("inf")
    x[4] = float("-inf")  # nothing but -inf: index 0
    x[5] = 1.0  # all equal: index 0
    x[6, 33000] = float("inf")
    x[7, :20] = float("nan")
    x[8, 17] = x[8, 18] = 99.0  # a tie within one vector
    assert ops.argmax_rows(x) == x.argmax(dim=-1).tolist()
    assert ops.argmax_rows(x[:1]) == [int(x[0].argmax())]
    short = x[:, :10].contiguous()  # shorter than a vector
    assert ops.argmax_rows(short) == short.argmax(dim=-1).tolist()


@pytest.mark.skipif(not ops.gelu_mul_available(), reason="no AVX-512, AVX2 or OpenMP: torch's ops")
def test_gated_gelu_kernel_matches_the_formula_on_strided_rows() -> None:
    import math

    f = 2048
    wide = _randn(7, 2 * f + 64, seed=12, scale=3.0)
    gate_up = wide[:, : 2 * f]  # rows 2F + 64 apart, as a slice of a wider projection would be
    got = ops.gelu_mul(gate_up).double()
    g, up = gate_up[:, :f].double(), gate_up[:, f:].double()
    u = math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    gelu = g / (1 + torch.exp(-2 * u))  # = g/2 (1 + tanh(u)), without that form's cancellation for large negative g
    expected = gelu.to(BF16).double() * up  # torch's bf16 intermediate, then the product
    # the product's bf16 rounding (2^-8), and at most one bf16 step on the intermediate where float32 sits on a tie
    assert (got - expected).abs().le(2.0**-7 * expected.abs() + 1e-30).all()
    assert torch.equal(ops.gelu_mul(gate_up[2:3])[0], ops.gelu_mul(gate_up)[2].to(BF16))  # rows independent
