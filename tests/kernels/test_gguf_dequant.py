"""The C lookup of a GGUF table's rows (gguf_dequant.c) against gguf-py's dequantisation, bit for bit."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.model.gguf_blocks import TYPES, random_blocks, weights, width
from tokenmill.kernels import ops
from tokenmill.model.gguf_linear import GgufEmbedding, GgufWeight
from tokenmill.model.gguf_quant import dequantize_rows

pytestmark = pytest.mark.skipif(ops.library() is None, reason="the C kernels are not built here")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rows_equal_gguf_bit_for_bit(t: T) -> None:
    raw, k = weights(t)
    ids = torch.tensor([[3, 0], [raw.shape[0] - 1, 3]])
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), t))[ids]
    out = ops.gguf_dequantize_rows(raw, t, k, ids)
    assert out.dtype == torch.float32 and out.shape == (2, 2, k)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_arbitrary_bytes_give_the_torch_decodings_bits(t: T) -> None:
    """Random bytes: scales of every fp16 kind (subnormal, infinite, NaN) and every code."""
    raw = random_blocks(t, 64, width(t), seed=5)
    ids = torch.arange(64)
    ref = dequantize_rows(raw, t, width(t), ids)
    out = ops.gguf_dequantize_rows(raw, t, width(t), ids)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_ids_outside_the_table_and_unknown_types_are_refused() -> None:
    raw, k = weights(T.Q8_0)
    with pytest.raises(IndexError):
        ops.gguf_dequantize_rows(raw, T.Q8_0, k, torch.tensor([raw.shape[0]]))
    with pytest.raises(IndexError):
        ops.gguf_dequantize_rows(raw, T.Q8_0, k, torch.tensor([-1]))
    with pytest.raises(ValueError):
        ops.gguf_dequantize_rows(raw, int(T.Q2_K), k, torch.tensor([0]))


def test_the_embedding_looks_up_through_it() -> None:
    raw, k = weights(T.Q4_K)
    embedding = GgufEmbedding(GgufWeight(int(T.Q4_K), raw, k), torch.bfloat16)
    ids = torch.tensor([7, 1, 7])
    assert torch.equal(embedding(ids), dequantize_rows(raw, T.Q4_K, k, ids).to(torch.bfloat16))
