"""A decoder layer as one C call (kernels/decoder_layer.c): the plan a layer hands it, built once, and when it can.

On the bf16 + GGUF path a decode step runs a dozen small kernels per layer, and around each Python's module calls,
views and allocations cost more than a small kernel itself. A layer class that mixes in CLayer builds its plan on
first use (what does not change between steps: shapes, norm factors, each projection's GGUF parts) and then runs in
one call, the same kernels in the same order as its modules call them, so the same bits.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tokenmill.kernels import ops
from tokenmill.model.gguf_linear import GgufLinear

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the plan's fields, in the order layers pass their linears


class CLayer:
    """Mixed into a decoder layer: `c_plan_for(dtype)` is its plan where the C layer can run it, else None."""

    # the tests turn it off to compare the two paths
    c_layer: ClassVar[bool] = True
    _plan: ops.DecoderLayerPlan | None = None  # None once planned: the C layer cannot run this layer
    _planned = False

    def c_plan_for(self, dtype: torch.dtype) -> ops.DecoderLayerPlan | None:
        """The plan where this layer runs as one C call on activations of `dtype` (bf16 only); else None."""
        return self.c_plan() if self.c_layer and dtype == torch.bfloat16 else None

    def c_plan(self) -> ops.DecoderLayerPlan | None:
        """The layer as decoder_layer.c takes it, built on first use; None where that C path cannot run it."""
        if not self._planned:
            self._plan, self._planned = self._build_plan(), True
        return self._plan

    def _build_plan(self) -> ops.DecoderLayerPlan | None:
        raise NotImplementedError


def projections(attn: Any, mlp: Any) -> tuple[torch.nn.Module, ...]:
    """A layer's four projections, in PROJECTIONS' order (its attention and MLP modules name them alike)."""
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def plannable(attn: Any, mlp: Any) -> bool:
    """The kernels are built, every projection is GGUF blocks the C matmul takes, and the shapes fit the kernels."""
    return (
        ops.library() is not None
        and ops.decoder_layer_available()
        and all(
            isinstance(m, GgufLinear) and m.kernel and len(m.types) <= ops.GGUF_LINEAR_MAX_PARTS
            for m in projections(attn, mlp)
        )
        and attn.head_dim % 16 == 0
        and attn.head_dim <= min(ops.MAX_ATTENTION_HEAD_DIM, ops.MAX_HEAD_DIM)
        and mlp.gate_up_proj.out_features % 32 == 0
    )


def layer_plan(attn: Any, mlp: Any, **fields: Any) -> ops.DecoderLayerPlan:
    """The plan: the shapes and the attention's scale from the layer's modules, `fields` the rest (eps, the norms'
    factors' addresses), and the four projections' parts (qkv, o, gate_up, down)."""
    plan = ops.DecoderLayerPlan(
        hidden=attn.o_proj.out_features,
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        ffn=mlp.gate_up_proj.out_features // 2,
        scale=attn.scale,
        softcap=0.0,
        **fields,
    )
    for field, linear in zip(PROJECTIONS, projections(attn, mlp), strict=True):
        assert isinstance(linear, GgufLinear)
        projection = getattr(plan, field)
        projection.k, projection.n = linear.k, linear.out_features
        parts = linear.kernel_parts()
        projection.parts = len(parts)
        for i, (ggml_type, packed, n, at) in enumerate(parts):
            projection.part[i] = ops.GgufPart(ggml_type, packed.data_ptr(), n, at)
    return plan
