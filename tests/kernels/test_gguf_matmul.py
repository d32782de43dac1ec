"""gguf_matmul.c: GGUF blocks multiplied as they are, checked against the torch reference of gguf_quant.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.kernels.avx2_build import RUNS_HERE, avx2_library
from tests.model.gguf_blocks import TYPES, activations, weights
from tokenmill.kernels import ops
from tokenmill.model.gguf_quant import gguf_matmul, quantize_activations

pytestmark = pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
XBLOCK = ops.GGUF_XBLOCK_BYTES


def kernel(x: torch.Tensor, raw: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """The C product in float32, on the file's blocks regrouped for it."""
    out = torch.empty(x.shape[0], raw.shape[0])
    ops.gguf_matmul(x.to(torch.bfloat16), t, ops.gguf_repack(raw, t, k), raw.shape[0], out)
    return out


def test_activation_blocks_hold_the_reference_codes_scales_and_sums() -> None:
    x = activations(5, 96).to(torch.bfloat16)
    x[2, 32:64] = 0.0
    x[3, 5] = float("nan")
    blocks = ops.gguf_quantize_rows(x).view(5, 3, XBLOCK)
    q, d = quantize_activations(x)
    codes = blocks[..., 16:].contiguous().view(torch.int8).reshape(5, 96)
    scales = blocks[..., :4].contiguous().view(torch.float32).reshape(5, 3)
    sums = blocks[..., 4:8].contiguous().view(torch.int32).reshape(5, 3)
    halves = blocks[..., 8:16].contiguous().view(torch.int32).reshape(5, 3, 2)
    assert torch.equal(codes, q)
    assert torch.equal(scales.nan_to_num(-1.0), d.nan_to_num(-1.0)) and scales[3, 0].isnan()
    assert torch.equal(sums, q.view(5, 3, 32).sum(-1, dtype=torch.int32))
    assert torch.equal(halves, q.view(5, 3, 2, 16).sum(-1, dtype=torch.int32))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [48, 45, 3])
def test_the_product_equals_the_torch_reference_for_any_column_count(t: T, n: int) -> None:
    raw, k = weights(t, n=n)
    x = activations(9, k)
    ref = gguf_matmul(x.to(torch.bfloat16), raw, t, k)
    assert torch.allclose(kernel(x, raw, t, k), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_batch(t: T) -> None:
    raw, k = weights(t)
    x = activations(19, k)
    x[4, 3] = float("nan")  # a bad row is NaN and leaves the others alone
    full = kernel(x, raw, t, k)
    assert full[4].isnan().all() and not full[[0, 1, 2, 3, 5]].isnan().any()
    for i in range(19):
        assert torch.equal(kernel(x[i : i + 1], raw, t, k)[0].nan_to_num(), full[i].nan_to_num())
    for rows in (2, 3, 5, 8, 9, 12):
        assert torch.equal(kernel(x[:rows], raw, t, k).nan_to_num(), full[:rows].nan_to_num())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rows_past_a_chunk_of_64_do_not_depend_on_the_batch(t: T) -> None:
    """The kernel takes the rows 64 at a time; a last pass of one row among many (65, 129 rows) must read that row's
    own blocks. It once read the first row's, as a batch of one would: a step of exactly 65 tokens gave its last row
    (a prompt's last token, the one whose logits are sampled) another token's numbers."""
    raw, k = weights(t)
    x = activations(130, k)
    alone = {i: kernel(x[i : i + 1], raw, t, k)[0] for i in (0, 1, 63, 64, 65, 127, 128, 129)}
    for m in (63, 64, 65, 66, 127, 128, 129, 130):
        full = kernel(x[:m], raw, t, k)
        for i, row in alone.items():
            if i < m:
                assert torch.equal(full[i], row), (m, i)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_every_column_is_computed_once_whatever_the_thread_count(t: T) -> None:
    """The threads claim groups of 16 columns from even shares and take over what is left of each other's: with more
    threads than cores (so some wait while others take their share) or than groups (empty shares), every column is
    written, with the bits one thread gives."""
    raw, k = weights(t, n=16 * 23 + 5)
    x = activations(17, k).to(torch.bfloat16)
    packed, n = ops.gguf_repack(raw, int(t), k), raw.shape[0]
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3, 8, 40):
            torch.set_num_threads(count)
            out = torch.full((17, n), float("nan"))
            ops.gguf_matmul(x, int(t), packed, n, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert not outs[0].isnan().any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_bf16_output_is_the_float32_output_rounded() -> None:
    raw, k = weights(T.Q5_0)
    x = activations(3, k).to(torch.bfloat16)
    packed = ops.gguf_repack(raw, int(T.Q5_0), k)
    wide, narrow = torch.empty(3, 48), torch.empty(3, 48, dtype=torch.bfloat16)
    ops.gguf_matmul(x, int(T.Q5_0), packed, 48, wide)
    ops.gguf_matmul(x, int(T.Q5_0), packed, 48, narrow)
    assert torch.equal(narrow, wide.to(torch.bfloat16))


def test_a_part_writes_only_its_columns_of_a_wider_output() -> None:
    raw, k = weights(T.Q4_K)
    out = torch.full((2, 60), 7.0)
    ops.gguf_matmul(
        activations(2, k).to(torch.bfloat16), int(T.Q4_K), ops.gguf_repack(raw, int(T.Q4_K), k), 48, out[:, 5:]
    )
    assert (out[:, :5] == 7).all() and (out[:, 53:] == 7).all()
    assert torch.equal(out[:, 5:53], kernel(activations(2, k), raw, int(T.Q4_K), k))


def test_unsupported_layouts_are_refused() -> None:
    raw, _ = weights(T.Q4_K)
    with pytest.raises(ValueError, match="not a layout"):  # K-quants need whole 256-weight blocks
        ops.gguf_matmul(activations(1, 96).to(torch.bfloat16), int(T.Q4_K), raw, 48, torch.empty(1, 48))
    with pytest.raises(ValueError, match="no packed layout"):
        ops.gguf_repack(raw, int(T.Q4_K), 96)
    with pytest.raises(ValueError, match="no packed layout"):
        ops.gguf_repack(raw, int(T.F16), 96)


@pytest.mark.skipif(not RUNS_HERE, reason="the AVX2 build cannot run here")
def test_the_avx2_build_gives_the_same_bits(tmp_path: Path) -> None:
    """Both paths compute the same integers exactly and the same float operations in the same order."""
    avx2 = avx2_library(tmp_path, "gguf_matmul")
    for t in TYPES:
        raw, k = weights(t)
        x = activations(6, k).to(torch.bfloat16)
        xq = ops.gguf_quantize_rows(x)
        xq2 = torch.empty_like(xq)
        assert avx2.gguf_quantize_rows(x.data_ptr(), k, 6, k, xq2.data_ptr(), 2) == 0
        assert torch.equal(xq, xq2)
        w = ops.gguf_repack(raw, int(t), k)
        w2 = torch.empty_like(w)
        assert avx2.gguf_repack(int(t), raw.data_ptr(), 48, k, w2.data_ptr(), 2) == 0
        assert torch.equal(w, w2)  # one layout for both paths
        for m in (6, 1):  # one row takes a path of its own (each vector decoded just before its products)
            mine, theirs = torch.empty(m, 48), torch.empty(m, 48)
            ops.gguf_matmul(x[:m], int(t), w, 48, mine)
            assert avx2.gguf_matmul(x.data_ptr(), k, m, k, int(t), w.data_ptr(), 48, theirs.data_ptr(), 48, 1, 2) == 0
            assert torch.equal(mine, theirs), (t.name, m)
        mine_gated, theirs_gated = (
            ops.gguf_matmul_gated(x, int(t), w, 16, True),
            torch.empty(6, 16, dtype=torch.bfloat16),
        )
        status = avx2.gguf_matmul_gated(
            x.data_ptr(), k, 6, k, int(t), w.data_ptr(), 16, theirs_gated.data_ptr(), 16, 1, 2
        )
        assert status == 0 and torch.equal(mine_gated, theirs_gated), t.name
        for m in (6, 1):
            logits, argmax, finite = ops.gguf_matmul_logits(x[:m], int(t), w, 45)  # a partial last group
            theirs, at, ok = torch.empty(m, 45), torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int32)
            status = avx2.gguf_matmul_logits(
                x.data_ptr(), k, m, k, int(t), w.data_ptr(), 45, theirs.data_ptr(), 45, at.data_ptr(), ok.data_ptr(), 2
            )
            assert status == 0 and torch.equal(logits, theirs) and at.tolist() == argmax and ok.tolist() == finite


def test_input_rows_may_be_strided() -> None:
    raw, k = weights(T.Q8_0)
    wide = activations(4, 2 * k).to(torch.bfloat16)
    packed, out, expected = ops.gguf_repack(raw, int(T.Q8_0), k), torch.empty(4, 48), torch.empty(4, 48)
    ops.gguf_matmul(wide[:, k:], int(T.Q8_0), packed, 48, out)
    ops.gguf_matmul(wide[:, k:].contiguous(), int(T.Q8_0), packed, 48, expected)
    assert torch.equal(out, expected)


def gated_reference(x: torch.Tensor, t: int, packed: torch.Tensor, f: int, gelu: bool) -> torch.Tensor:
    """The two passes the gated one replaces: the (M, 2f) bf16 products, then gelu_mul or silu_mul."""
    products = torch.empty(x.shape[0], 2 * f, dtype=torch.bfloat16)
    ops.gguf_matmul(x, t, packed, 2 * f, products)
    return (ops.gelu_mul if gelu else ops.silu_mul)(products)


@pytest.mark.skipif(not ops.gelu_mul_available(), reason="no activation kernels here")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("gelu", [True, False], ids=["gelu", "silu"])
def test_the_gated_pass_gives_the_bits_of_the_product_then_the_activation(t: T, gelu: bool) -> None:
    raw, k = weights(t, n=96)  # the gate's 48 columns, then the up's 48
    packed = ops.gguf_repack(raw, int(t), k)
    x = activations(67, k).to(torch.bfloat16)
    for m in (1, 5, 16, 67):  # one row's own pass, a few rows, a row chunk of 64 and more
        got = ops.gguf_matmul_gated(x[:m], int(t), packed, 48, gelu)
        assert torch.equal(got, gated_reference(x[:m], int(t), packed, 48, gelu)), (m, got.shape)


@pytest.mark.skipif(not ops.gelu_mul_available(), reason="no activation kernels here")
def test_the_gated_pass_takes_only_whole_groups_of_16() -> None:
    raw, k = weights(T.Q8_0, n=80)
    packed = ops.gguf_repack(raw, int(T.Q8_0), k)
    with pytest.raises(ValueError, match="a multiple of 16"):
        ops.gguf_matmul_gated(activations(2, k).to(torch.bfloat16), int(T.Q8_0), packed, 40, True)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [48, 45], ids=["whole-groups", "partial-group"])
def test_the_logits_pass_finds_each_rows_argmax_and_finiteness(t: T, n: int) -> None:
    raw, k = weights(t, n=n)
    packed = ops.gguf_repack(raw, int(t), k)
    x = activations(67, k).to(torch.bfloat16)
    for m in (1, 5, 16, 67):  # one row's own pass, a few rows, a row chunk of 64 and more
        logits, argmax, finite = ops.gguf_matmul_logits(x[:m], int(t), packed, n)
        expected = torch.empty(m, n)
        ops.gguf_matmul(x[:m], int(t), packed, n, expected)
        assert torch.equal(logits, expected)
        assert argmax == expected.argmax(dim=-1).tolist(), (m, argmax)
        assert finite == [True] * m


def test_the_logits_pass_takes_the_first_of_equal_largest_values_whatever_the_threads() -> None:
    """Equal logits come from equal weight rows: the first column wins, whichever thread's claims found the others,
    and whether the equals share a group of 16 (same lane or not) or lie groups apart."""
    raw, k = weights(T.Q8_0, n=16 * 23 + 5)
    x = activations(3, k).to(torch.bfloat16)
    best = kernel(x, raw, int(T.Q8_0), k).argmax(dim=-1)
    for copies in ([40, 200, 301, 372], [best[0] + 1, best[0] + 16], [0, 7, 364]):
        tied = raw.clone()
        for row in (int(b) for b in best):  # every row's winner copied to each place: equal top values
            for at in copies:
                tied[int(at) % raw.shape[0]] = raw[row]
        packed, n = ops.gguf_repack(tied, int(T.Q8_0), k), tied.shape[0]
        expected = kernel(x, tied, int(T.Q8_0), k).argmax(dim=-1).tolist()
        threads = torch.get_num_threads()
        try:
            for count in (1, 2, 3, 8, 40):
                torch.set_num_threads(count)
                assert ops.gguf_matmul_logits(x, int(T.Q8_0), packed, n)[1] == expected, (copies, count)
        finally:
            torch.set_num_threads(threads)
    same = raw[:1].repeat(45, 1)  # every column equal: column 0
    _, argmax, _ = ops.gguf_matmul_logits(x, int(T.Q8_0), ops.gguf_repack(same, int(T.Q8_0), k), 45)
    assert argmax == [0, 0, 0]


def test_the_logits_pass_flags_a_row_that_is_not_finite_and_only_it() -> None:
    raw, k = weights(T.Q6_K)
    packed = ops.gguf_repack(raw, int(T.Q6_K), k)
    for m, bad in ((1, 0), (5, 3), (20, 17)):
        x = activations(m, k).to(torch.bfloat16)
        x[bad, 9] = float("nan") if bad % 2 else float("inf")
        logits, argmax, finite = ops.gguf_matmul_logits(x, int(T.Q6_K), packed, raw.shape[0])
        assert finite == [r != bad for r in range(m)]
        assert not logits[bad].isfinite().all()
        good = [r for r in range(m) if r != bad]
        assert [argmax[r] for r in good] == logits[good].argmax(dim=-1).tolist()


AMX = ops.gguf_matmul_available() and ops.gguf_amx()


@pytest.mark.skipif(not AMX, reason="no AMX here (or the OS does not grant its tile state)")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_the_amx_path_gives_the_vnni_paths_bits(t: T) -> None:
    """Whole tiles of 16 rows go to AMX (all types but Q6_K), the rows left over to VNNI: every row count, with a NaN
    row among them, must give the bits of the VNNI path alone."""
    for n in (48, 45):
        raw, k = weights(t, n=n)
        packed = ops.gguf_repack(raw, int(t), k)
        for m in (15, 16, 17, 33, 64, 65, 70, 130):
            x = activations(m, k).to(torch.bfloat16)
            x[7, 3] = float("nan")
            outs = []
            for amx in (True, False):
                ops.gguf_amx(amx)
                out = torch.empty(m, n)
                ops.gguf_matmul(x, int(t), packed, n, out)
                outs.append(out)
            ops.gguf_amx(True)
            assert outs[0][7].isnan().all() and not outs[0][8:].isnan().any()
            assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num()), (t.name, n, m)


@pytest.mark.skipif(not AMX, reason="no AMX here (or the OS does not grant its tile state)")
def test_amx_rows_do_not_depend_on_the_batch() -> None:
    """A row computed in a tile of 16 equals the same row computed alone (VNNI) or in another tile."""
    raw, k = weights(T.Q5_0)
    x = activations(40, k)
    full = kernel(x, raw, int(T.Q5_0), k)
    for lo, hi in ((0, 1), (3, 19), (24, 40), (5, 37)):
        assert torch.equal(kernel(x[lo:hi], raw, int(T.Q5_0), k), full[lo:hi])
