"""The kernels written once over vec16.h (attention, the gated activations, argmax, LoRA updates): their AVX2 build (-march=haswell)
gives the native build's bits, so a CPU without AVX-512 computes what one with it does (on an AVX-512 machine this
holds the two paths equal; on an AVX2 one, the two compilations)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.kernels.avx2_build import RUNS_HERE, avx2_library
from tests.kernels.lora_updates import packed
from tokenmill.kernels import ops

pytestmark = pytest.mark.skipif(not RUNS_HERE, reason="the AVX2 build cannot run here")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def avx2(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return avx2_library(tmp_path_factory.mktemp("avx2"), "paged_attention")


@pytest.mark.skipif(not ops.paged_attention_available(), reason="no native attention kernel here")
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 256), (6, 1, 64), (3, 3, 80)])
@pytest.mark.parametrize("softcap", [0.0, 0.1])
@pytest.mark.parametrize("kv_int8", [0, 1])
def test_attention(avx2: ctypes.CDLL, hq: int, hkv: int, d: int, softcap: float, kv_int8: int) -> None:
    if kv_int8 and d % ops.KV_INT8_BLOCK:
        pytest.skip("an 8-bit cache's rows are whole blocks of 32")
    gen = torch.Generator().manual_seed(d + hq)
    k_cache = torch.randn(600, hkv, d, generator=gen).to(BF16)
    v_cache = torch.randn(600, hkv, d, generator=gen).to(BF16)
    if kv_int8:  # an 8-bit cache's rows: codes and scale
        k_cache, v_cache = ops.kv_quantize_rows(k_cache), ops.kv_quantize_rows(v_cache)
    slots = torch.randperm(600, generator=gen)[:70]
    q = (torch.randn(5, hq, d, generator=gen) * 0.3).to(BF16)
    offset = torch.zeros(5, dtype=torch.int64)
    count = torch.tensor([1, 2, 17, 33, 70])  # ragged ends of the 16-lane softmax passes
    native = ops.paged_attention(q, k_cache, v_cache, slots, offset, count, d**-0.5, softcap)
    out = torch.empty_like(native)
    args = (q.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), offset.data_ptr())
    assert (
        avx2.paged_attention(*args, count.data_ptr(), 5, hq, hkv, d, d**-0.5, softcap, kv_int8, out.data_ptr(), 2) == 0
    )
    assert torch.equal(native.view(torch.int16), out.view(torch.int16))


@pytest.mark.skipif(not ops.paged_attention_available(), reason="no native attention kernel here")
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 1, 256), (8, 2, 64)])
def test_attention_over_chunks_of_keys(avx2: ctypes.CDLL, hq: int, hkv: int, d: int) -> None:
    """Rows over ATTENTION_KEY_CHUNK keys, chunk by chunk: the same bits from both builds, and a row's bits the same
    decoded alone or among three (its chunks shared between the threads) as among four (each row's chunks on one
    thread, the rows shared evenly)."""
    chunk = ops.ATTENTION_KEY_CHUNK
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(5 * chunk, hkv, d, generator=gen).to(BF16)
    v_cache = torch.randn(5 * chunk, hkv, d, generator=gen).to(BF16)
    slots = torch.randperm(5 * chunk, generator=gen)
    q = (torch.randn(4, hq, d, generator=gen) * 0.3).to(BF16)
    offset = torch.zeros(4, dtype=torch.int64)
    # a chunk of one key; whole chunks; a ragged end; one short row
    count = torch.tensor([chunk + 1, 2 * chunk, 4 * chunk + 77, 40])

    def attention(lib: ctypes.CDLL, rows: slice) -> torch.Tensor:  # on two threads, as a 2-core server runs it
        qs, n = q[rows].contiguous(), count[rows]
        out = torch.empty_like(qs)
        args = (qs.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), offset.data_ptr())
        assert lib.paged_attention(*args, n.data_ptr(), len(n), hq, hkv, d, d**-0.5, 0.0, 0, out.data_ptr(), 2) == 0
        return out.view(torch.int16)

    native = ops.library()
    assert native is not None
    batch = attention(native, slice(0, 4))
    assert torch.equal(attention(native, slice(0, 3)), batch[:3])
    for r in range(4):
        assert torch.equal(attention(native, slice(r, r + 1))[0], batch[r]), r
    assert torch.equal(attention(avx2, slice(0, 4)), batch)
    assert torch.equal(attention(avx2, slice(0, 3)), batch[:3])
    # and right: float64 softmax attention, to bf16's rounding
    keys, values = k_cache[slots].double(), v_cache[slots].double()
    for r in range(4):
        for h in range(hq):
            kv = h // (hq // hkv)
            weights = torch.softmax(q[r, h].double() @ keys[: count[r], kv].T * d**-0.5, dim=-1)
            expected = weights @ values[: count[r], kv]
            got = batch[r, h].view(BF16).double()
            assert (got - expected).abs().le(2.0**-8 * expected.abs() + 1e-4).all(), (r, h)


@pytest.mark.skipif(not ops.gelu_mul_available(), reason="no native activation kernels here")
@pytest.mark.parametrize("kernel", ["gelu_mul", "silu_mul"])
def test_gated_activations(avx2: ctypes.CDLL, kernel: str) -> None:
    f = 1024
    gate_up = (torch.randn(9, 2 * f, generator=torch.Generator().manual_seed(5)) * 6.0).to(BF16)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 90.0, -90.0, 3e38, float("-inf")])  # the exp's edges
    native = getattr(ops, kernel)(gate_up)
    out = torch.empty_like(native)
    getattr(avx2, kernel)(gate_up.data_ptr(), 2 * f, 9, f, out.data_ptr(), 2)
    assert torch.equal(native.view(torch.int16), out.view(torch.int16))


@pytest.mark.skipif(not ops.argmax_available(), reason="no native argmax here")
def test_argmax(avx2: ctypes.CDLL) -> None:
    n = 2 * 32768 + 9
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(6))
    x[1, 3] = x[1, 40000] = 80.0  # a tie across segments
    x[2, 99] = float("nan")
    x[3] = float("-inf")
    x[4, n - 1] = 90.0
    out = torch.empty(5, dtype=torch.int64)
    assert avx2.argmax_rows(x.data_ptr(), 5, n, out.data_ptr(), 2) == 0
    assert out.tolist() == ops.argmax_rows(x) == x.argmax(dim=-1).tolist()


@pytest.mark.skipif(ops.library() is None, reason="no native kernels here")
def test_lora_update(avx2: ctypes.CDLL) -> None:
    _, update = packed([1024, 256, 256], 640, [16, 16, 16])
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(7)).to(BF16)
    y = torch.randn(5, 1536, generator=torch.Generator().manual_seed(8)).to(BF16)
    native, out = y.clone(), y.clone()
    rows = [0, 1, 4]
    ops.lora_update_rows(update.c, rows, x, native)
    indices = (ctypes.c_int64 * 3)(*rows)
    avx2.lora_update_rows(
        ctypes.addressof(update.c), ctypes.addressof(indices), 3, x.data_ptr(), 640, out.data_ptr(), 1536, 2
    )
    assert torch.equal(native.view(torch.int16), out.view(torch.int16))
