"""gguf_greedy_row: a lone greedy row's LM head from the 6-bit copy of a Q8_0 head, held to the full pass
(gguf_matmul_logits): the same argmax, and the full pass's bits for every column it computes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.kernels.avx2_build import RUNS_HERE, avx2_library
from tests.model.gguf_blocks import activations, weights
from tokenmill.kernels import ops
from tokenmill.model.gguf_quant import dequantize

pytestmark = pytest.mark.skipif(not ops.gguf_matmul_available(), reason="the GGUF kernel is not built here")
Q8_0, HIGH6 = int(T.Q8_0), ops.GGUF_Q8_0_HIGH6
N = 16 * 97 + 5  # a partial last group


def head(n: int = N, seed: int = 0) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """A Q8_0 head's file rows, its width, and its two layouts (Q8_0, HIGH6)."""
    raw, k = weights(T.Q8_0, n=n, seed=seed)
    return raw, k, ops.gguf_repack(raw, Q8_0, k), ops.gguf_repack(raw, HIGH6, k)


def peaked_rows(raw: torch.Tensor, k: int, columns: list[list[int]], noise: float = 0.5) -> torch.Tensor:
    """One row per entry: the sum of those columns' weights plus noise, so that they lead the row's logits (near-ties
    where an entry names two columns), as a trained model's hidden state leads to a few tokens."""
    w = dequantize(raw, Q8_0, k)
    rows = [w[c].sum(0) / w[c[0]].norm() + noise * activations(1, k, seed=i)[0] / k**0.5 for i, c in enumerate(columns)]
    return torch.stack(rows).to(torch.bfloat16)


def full(x: torch.Tensor, packed: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    logits, argmax, finite = ops.gguf_matmul_logits(x, Q8_0, packed, n)
    assert finite == [True]
    return logits[0], argmax[0]


def check(x: torch.Tensor, q8: torch.Tensor, h6: torch.Tensor, n: int, keep: list[int]) -> torch.Tensor:
    """The pruned answer against the full pass; returns the columns it computed."""
    got = ops.gguf_greedy_row(x, h6, q8, n, keep)
    assert got is not None, "the row was peaked enough to prune"
    logits, argmax = got
    expected, best = full(x, q8, n)
    computed = logits[0].isfinite()
    assert argmax == best
    assert torch.equal(logits[0][computed], expected[computed])  # the full pass's bits
    assert (logits[0][~computed] == float("-inf")).all()
    assert computed[keep].all()
    untouched = expected.clone()
    untouched[keep] = float("-inf")
    assert computed[int(untouched.argmax())]  # the best column the sampler's changes leave alone is among them
    return computed


def test_the_argmax_and_every_computed_value_are_the_full_passs() -> None:
    raw, k, q8, h6 = head()
    leaders = [[3], [N - 1], [700, 701], [16 * 40, 16 * 90 + 2], [1000, 1000 + 16 * 3 + 1], [5]]
    x = peaked_rows(raw, k, leaders)
    for i in range(len(leaders)):
        computed = check(x[i : i + 1], q8, h6, N, [])
        assert computed.sum() < N // 4  # most groups were left out: the pass did prune


def test_the_bound_is_as_wide_as_the_two_low_bits_can_move_a_logit() -> None:
    """Two leading columns against a row of positive inputs, every code's scale the same: B's codes all 103 (low bits
    3), A's 100 (low bits 0) but 104 on a set of inputs holding just under 3/4 of the row's weight. The copy puts A
    ahead of B by just under the widest the low bits allow (3/2 of the row's weight from each side); exactly, B wins by
    a hair. A bound any narrower leaves B out and answers A."""
    raw, k = weights(T.Q8_0, n=N)
    x = (activations(1, k, seed=3).abs() + 0.1).to(torch.bfloat16)
    blocks = ops.gguf_quantize_rows(x).view(k // 32, ops.GGUF_XBLOCK_BYTES)
    scale = blocks[:, :4].contiguous().view(torch.float32)  # (blocks, 1)
    codes = blocks[:, 16:].contiguous().view(torch.int8).float()  # (blocks, 32)
    weight = (scale * codes).flatten().double()  # what each input adds per unit of code
    a = torch.full((k,), 100, dtype=torch.int32)
    taken = 0.0
    for i in range(k):  # the inputs A's extra step covers: just under 3/4 of the row's weight
        if taken + weight[i] < 0.749 * float(weight.sum()):
            a[i], taken = 104, taken + float(weight[i])
    b = torch.full((k,), 103, dtype=torch.int32)
    tied = raw.clone().view(N, k // 32, 34)
    B = 16 * 50 + 3
    for column, new in ((41, a), (B, b)):  # in different groups of 16: each group is computed whole
        tied[column, :, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        tied[column, :, 2:] = new.to(torch.int8).view(k // 32, 32).view(torch.uint8)
    tied = tied.view(N, -1)
    q8, h6 = ops.gguf_repack(tied, Q8_0, k), ops.gguf_repack(tied, HIGH6, k)
    logits, best = full(x, q8, N)
    assert best == B and logits[B] > logits[41]
    check(x, q8, h6, N, [])


def test_kept_ids_are_computed_and_set_no_floor() -> None:
    """A kept id (biased, banned, penalised) is computed whatever its bound; and kept out of the floor, even the row's
    argmax, so that the best of the others is computed too (the sampler may ban the argmax)."""
    raw, k, q8, h6 = head()
    x = peaked_rows(raw, k, [[200], [300, 301]])
    for i in range(2):
        row = x[i : i + 1]
        best = full(row, q8, N)[1]
        for keep in ([best], [0, best, N - 1], [1, 2, 17], sorted({best, 299, 302, 1500})):
            check(row, q8, h6, N, keep)


def test_the_first_of_equal_largest_values_wins_whatever_the_threads() -> None:
    raw, k, _, _ = head()
    x = peaked_rows(raw, k, [[50]])
    tied = raw.clone()
    for at in (16 * 70 + 9, 16 * 3 + 2, 51):
        tied[at] = raw[50]  # equal rows: equal logits
    q8, h6 = ops.gguf_repack(tied, Q8_0, k), ops.gguf_repack(tied, HIGH6, k)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 8):
            torch.set_num_threads(count)
            got = ops.gguf_greedy_row(x, h6, q8, N, [])
            assert got is not None and got[1] == 16 * 3 + 2 == full(x, q8, N)[1], count
    finally:
        torch.set_num_threads(threads)


def test_a_row_it_cannot_answer_is_left_to_the_full_pass() -> None:
    raw, k, q8, h6 = head()
    flat = torch.zeros(1, k, dtype=torch.bfloat16)  # every logit 0: every column could be the largest
    assert ops.gguf_greedy_row(flat, h6, q8, N, []) is None
    for bad in (float("nan"), float("inf")):
        x = peaked_rows(raw, k, [[9]])
        x[0, 4] = bad
        assert ops.gguf_greedy_row(x, h6, q8, N, []) is None


def test_keeps_it_cannot_take_are_refused() -> None:
    raw, k, q8, h6 = head(n=64)
    x = peaked_rows(raw, k, [[9]])
    for keep in ([5, 3], [2, 2], [-1], [64]):
        with pytest.raises(ValueError):
            ops.gguf_greedy_row(x, h6, q8, 64, keep)


def test_the_copy_holds_each_code_less_its_two_low_bits() -> None:
    """HIGH6 regroups a Q8_0 tensor's codes as Q6_K's unsigned codes: floor(q / 4) + 32, Q6_K's 4 + 2-bit planes."""
    raw, k = weights(T.Q8_0, n=16)
    blocks = raw.view(16, k // 32, 34)
    q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32)  # (16 columns, blocks, 32)
    expected = torch.div(q, 4, rounding_mode="floor") + 32
    h6 = ops.gguf_repack(raw, HIGH6, k).view(k // 32, 416)
    assert torch.equal(
        h6[:, :32].contiguous().view(torch.float16), blocks[..., :2].contiguous().view(torch.float16)[..., 0].T
    )
    low, high = h6[:, 32:288].to(torch.int32), h6[:, 288:416].to(torch.int32)
    for g in range(8):  # vector g: elements 4g..4g+3 of every column, byte 4c + e
        nibble = (low[:, 64 * (g % 4) : 64 * (g % 4 + 1)] >> (4 if g >= 4 else 0)) & 15
        two = (high[:, 64 * (g // 4) : 64 * (g // 4 + 1)] >> (2 * (g % 4))) & 3
        codes = (nibble | two << 4).view(k // 32, 16, 4)  # (blocks, columns, 4 elements)
        assert torch.equal(codes, expected[:, :, 4 * g : 4 * g + 4].permute(1, 0, 2)), g


@pytest.mark.skipif(not RUNS_HERE, reason="the AVX2 build cannot run here")
def test_the_avx2_build_gives_the_same_answer_and_bits(tmp_path: Path) -> None:
    avx2 = avx2_library(tmp_path, "gguf_matmul")
    raw, k, q8, h6 = head()
    theirs_h6 = torch.empty_like(h6)
    assert avx2.gguf_repack(HIGH6, raw.data_ptr(), N, k, theirs_h6.data_ptr(), 2) == 0
    assert torch.equal(h6, theirs_h6)
    x = peaked_rows(raw, k, [[3], [700, 701], [1000, 1000 + 16 * 3 + 1]])
    for i in range(3):
        keep = torch.tensor([1, 2, 1500], dtype=torch.int64)
        got = ops.gguf_greedy_row(x[i : i + 1], h6, q8, N, keep.tolist())
        assert got is not None
        out, at = torch.empty(1, N), torch.empty(1, dtype=torch.int64)
        status = avx2.gguf_greedy_row(
            x[i].data_ptr(), k, h6.data_ptr(), q8.data_ptr(), N, keep.data_ptr(), 3, out.data_ptr(), at.data_ptr(), 2
        )
        assert status == 0 and int(at) == got[1] and torch.equal(out, got[0])


def test_a_team_smaller_than_asked_for_answers_the_same() -> None:
    """OpenMP may give the call fewer threads than it asks for (OMP_THREAD_LIMIT, nesting): the shares no thread took
    set no floor. Every logit negative here, so a floor of 0 left unset would leave every column out."""
    script = textwrap.dedent(
        """
        import torch
        from gguf import GGMLQuantizationType as T
        from tests.kernels.test_gguf_greedy_row import Q8_0, HIGH6, N, full, head, peaked_rows
        from tokenmill.kernels import ops
        torch.set_num_threads(2)
        raw, k, q8, h6 = head()
        x = -peaked_rows(raw, k, [[77]]).abs()
        codes = raw.view(N, k // 32, 34)[..., 2:].view(torch.int8)
        codes.copy_(codes.abs().clamp(min=40, max=127))  # every code positive against every input negative
        codes[77] = 8  # the least negative logit by far, and still below 0 by more than its bound
        q8, h6 = ops.gguf_repack(raw, Q8_0, k), ops.gguf_repack(raw, HIGH6, k)
        logits, best = full(x, q8, N)
        assert (logits < 0).all()
        got = ops.gguf_greedy_row(x, h6, q8, N, [])
        assert got is not None and got[1] == best, (got and got[1], best)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "OMP_THREAD_LIMIT": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
