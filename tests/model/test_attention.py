"""Paged attention: right values, and a row's bits independent of its batch, its prefill and its cache layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import ops
from tokenmill.model.attention import CHUNK, AttentionMetadata, dequantize_kv, paged_attention, quantize_kv

HQ, HKV, D = 4, 1, 32
SCALE = D**-0.5


def _cache(num_slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(num_slots, HKV, D, generator=gen).to(dtype)
    v = torch.randn(num_slots, HKV, D, generator=gen).to(dtype)
    return k, v


def _run(
    cache: tuple[torch.Tensor, torch.Tensor],
    seqs: list[tuple[torch.Tensor, int]],  # (slots of the whole context, query rows at its end)
    q: torch.Tensor,  # (T, HQ, D)
    window: int | None,
) -> torch.Tensor:
    k_cache, v_cache = cache
    rows = [(slots[len(slots) - n :]) for slots, n in seqs]
    slot_mapping = torch.cat(rows)
    meta = AttentionMetadata.from_kv_slots(
        slot_mapping=slot_mapping,
        query_lens=[n for _, n in seqs],
        context_lens=[len(slots) for slots, _ in seqs],
        kv_slots=[slots for slots, _ in seqs],
    )
    # rewrite the rows' own K/V with what is already there, so every run sees the same cache
    return paged_attention(q, k_cache[slot_mapping], v_cache[slot_mapping], (k_cache, v_cache), meta, SCALE, window)


def _use(kernel: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """bf16 attention runs the C kernel where it compiled (paged_attention.c); the torch path must hold up too.
    Returns a list that grows by one per C kernel call."""
    calls: list[int] = []
    if kernel == "c" and not ops.paged_attention_available():
        pytest.skip("no AVX-512, AVX2 or OpenMP: the torch path is the only path")
    if kernel == "torch":
        monkeypatch.setattr(ops, "paged_attention_available", lambda: False)
    c_kernel = ops.paged_attention

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return c_kernel(*args)

    monkeypatch.setattr(ops, "paged_attention", counted)
    return calls


@pytest.mark.parametrize(
    ("dtype", "kernel"), [(torch.float32, "torch"), (torch.bfloat16, "c"), (torch.bfloat16, "torch")]
)
@pytest.mark.parametrize("window", [None, 40])
def test_rows_are_right_and_identical_alone_batched_and_in_prefill(
    dtype: torch.dtype, kernel: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    c_calls = _use(kernel, monkeypatch)
    cache = _cache(4096, dtype)
    gen = torch.Generator().manual_seed(2)
    perm = torch.randperm(4096, generator=gen)  # scattered slots, as a paged cache gives them
    # the last: the C kernel's chunks of keys, a single row's shared between the threads, a batch's rows each whole
    ctx = [3 * CHUNK + 5, 17, CHUNK, 2 * CHUNK + 1, 150, 2 * ops.ATTENTION_KEY_CHUNK + 37]
    seq_slots, at = [], 0
    for n in ctx:
        seq_slots.append(perm[at : at + n])
        at += n
    q_all = torch.randn(sum(ctx), HQ, D, generator=gen).to(dtype)
    queries, at = [], 0
    for n in ctx:
        queries.append(q_all[at : at + n])
        at += n

    # each sequence's last row decoded alone, then all of them decoded in one step
    alone = [_run(cache, [(s, 1)], q[-1:], window) for s, q in zip(seq_slots, queries)]
    batched = _run(cache, [(s, 1) for s in seq_slots], torch.cat([q[-1:] for q in queries]), window)
    for i, row in enumerate(alone):
        assert torch.equal(batched[i], row[0]), f"sequence {i}: batched decode differs from alone"

    # the whole context prefilled at once, beside another sequence's decode row
    for i, (s, q) in enumerate(zip(seq_slots, queries)):
        other = seq_slots[(i + 1) % len(ctx)]
        mixed = _run(cache, [(other, 1), (s, len(s))], torch.cat([queries[(i + 1) % len(ctx)][-1:], q]), window)
        prefill = mixed[1:]
        assert torch.equal(prefill[-1], alone[i][0]), f"sequence {i}: prefill's last row differs from its decode"
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output is rounded to bf16
        torch.testing.assert_close(prefill.double(), _reference(cache, s, q, window), atol=tol, rtol=0)
    assert bool(c_calls) == (kernel == "c")  # the path under test is the one that ran


def _reference(
    cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, q: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Plain softmax attention of every position over its visible keys, in float64 (one KV head)."""
    keys, values = cache[0][slots].double()[:, 0], cache[1][slots].double()[:, 0]  # (L, D)
    out = []
    for end in range(1, len(slots) + 1):
        lo = max(0, end - window) if window else 0
        weights = F.softmax(q[end - 1].double() @ keys[lo:end].T * SCALE, dim=-1)  # (HQ, visible)
        out.append(weights @ values[lo:end])
    return torch.stack(out)  # (L, HQ, D)


def test_long_prefill_is_split_into_row_slices_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(1024, torch.float32)
    slots = torch.arange(300)
    q = torch.randn(300, HQ, D, generator=torch.Generator().manual_seed(3))
    whole = _run(cache, [(slots, 300)], q, None)
    monkeypatch.setattr("tokenmill.model.attention.PREFILL_BYTES", 1)  # one row per call
    sliced = _run(cache, [(slots, 300)], q, None)
    assert torch.equal(whole, sliced)


@pytest.mark.skipif(not ops.paged_attention_available(), reason="no AVX-512, AVX2 or OpenMP: the torch path only")
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (100, None), (None, 0.1)])  # Gemma 2 softcap
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (6, 1), (3, 3)])  # the kernel takes query heads 4 at a time
def test_c_kernel_matches_float64_softmax_with_grouped_heads_at_the_real_head_size(
    window: int | None, softcap: float | None, hq: int, hkv: int
) -> None:
    d = 256
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(2048, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(2048, hkv, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(2048, generator=gen)[:300]
    q = (torch.randn(300, hq, d, generator=gen) * 0.2).to(torch.bfloat16)
    meta = AttentionMetadata(slots.tolist(), query_lens=[300], context_lens=[300], slots=slots, starts=[0])
    scale = d**-0.5
    got = paged_attention(q, k_cache[slots], v_cache[slots], (k_cache, v_cache), meta, scale, window, softcap)
    keys, values = k_cache[slots].double(), v_cache[slots].double()  # (L, Hkv, D)
    for end in (1, 2, 17, 150, 300):
        lo = max(0, end - window) if window else 0
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = q[end - 1, h].double() @ keys[lo:end, kv].T * scale
            weights = F.softmax(softcap * torch.tanh(scores / softcap) if softcap else scores, dim=-1)
            expected = weights @ values[lo:end, kv]
            # float32 arithmetic, then the output rounded to bf16 (2^-8 relative)
            assert (got[end - 1, h].double() - expected).abs().le(2.0**-8 * expected.abs() + 1e-4).all(), (end, h)


@pytest.mark.skipif(not ops.paged_attention_available(), reason="no AVX-512, AVX2 or OpenMP: the torch path only")
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize(("hq", "hkv"), [(6, 1), (8, 2)])
def test_a_prompts_rows_taken_together_over_each_chunk_give_each_rows_bits_alone(
    window: int | None, hq: int, hkv: int
) -> None:
    """Rows that follow one another in a prompt are computed in blocks, chunk of keys by chunk (attend_rows); a row
    decoded alone takes its chunks apart, over both threads. Both must give the same bits."""
    d, context, rows = 128, 3 * ops.ATTENTION_KEY_CHUNK + 50, 41
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(1024, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(1024, hkv, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(1024, generator=gen)[:context]
    q = torch.randn(rows, hq, d, generator=gen).to(torch.bfloat16)
    ends = torch.arange(context - rows + 1, context + 1)  # row i sees the keys before position ends[i]
    starts = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    together = ops.paged_attention(q, k_cache, v_cache, slots, starts, ends - starts, d**-0.5)
    for i in range(rows):
        alone = ops.paged_attention(
            q[i : i + 1], k_cache, v_cache, slots, starts[i : i + 1], (ends - starts)[i : i + 1], d**-0.5
        )
        assert torch.equal(together[i], alone[0]), f"row {i}"


def test_an_8bit_cache_row_is_codes_and_a_half_scale_per_32_the_same_in_c_and_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 2, 64, generator=gen) * torch.rand(40, 2, 64, generator=gen) * 3).to(torch.bfloat16)
    x[3, 1, :32] = 0  # a block of zeros: codes 0, scale 0
    x[4, 0, 5] = 200.0  # an outlier widens its own block's step only
    rows = quantize_kv(x)
    assert rows.shape == (40, 2, 68) and rows.dtype == torch.int8
    scale = rows[..., 64:].contiguous().view(torch.float16).float()  # (40, 2, 2)
    blocks = x.float().view(40, 2, 2, 32)
    assert torch.equal(scale, (blocks.abs().amax(-1) / 127).to(torch.float16).float())
    assert not rows[3, 1, :32].any() and scale[3, 1, 0] == 0
    error = (dequantize_kv(rows).view(40, 2, 2, 32) - blocks).abs()
    assert error.le(scale[..., None] * 0.51 + 1e-6).all()  # half a step, and the float16 scale's rounding
    assert error[4, 0, 1].max() < 0.02  # the outlier's neighbour block keeps its fine step
    if ops.library() is not None and ops.paged_attention_available():  # torch's arithmetic gives the C codes
        monkeypatch.setattr(ops, "usable", lambda t: False)
        assert torch.equal(quantize_kv(x), rows)


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_an_8bit_cache_attends_close_to_the_16bit_one(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _use(kernel, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d = 4, 1, 256
    k = torch.randn(300, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(300, hkv, d, generator=gen).to(torch.bfloat16)
    q = (torch.randn(300, hq, d, generator=gen) * 0.2).to(torch.bfloat16)
    slots = torch.randperm(512, generator=gen)[:300]
    meta = AttentionMetadata(slots.tolist(), query_lens=[300], context_lens=[300], slots=slots, starts=[0])
    bf16 = (torch.zeros(512, hkv, d, dtype=torch.bfloat16), torch.zeros(512, hkv, d, dtype=torch.bfloat16))
    int8 = (torch.zeros(512, hkv, d + 16, dtype=torch.int8), torch.zeros(512, hkv, d + 16, dtype=torch.int8))
    exact = paged_attention(q, k, v, bf16, meta, d**-0.5, None).float()
    eight = paged_attention(q, k, v, int8, meta, d**-0.5, None).float()
    assert bool(calls) == (kernel == "c")
    assert (eight - exact).abs().max() < 0.05 and (eight - exact).abs().mean() < 0.005
    if kernel == "torch":  # its float32 matmuls sum the dequantised products in an order that follows the shapes
        return
    # a row's bits alone are its bits in the prefill (the codes do not depend on the batch)
    last = AttentionMetadata([int(slots[-1])], query_lens=[1], context_lens=[300], slots=slots, starts=[0])
    alone = paged_attention(q[-1:], k[-1:], v[-1:], int8, last, d**-0.5, None)
    assert torch.equal(alone.view(torch.int16), eight[-1:].to(torch.bfloat16).view(torch.int16))
