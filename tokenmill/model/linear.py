"""The engine's linear layers: weight-only quantised for fast CPU decode, or row-padded for fp32 batch invariance.

A decode step reads every weight once per token, so on a memory-bound CPU the step time follows the weights' bytes:
int8 halves bf16's. Activations stay in the compute dtype and torch's own CPU kernels do the matmul
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`); quantising changes logits, so the unquantised modes stay for
scoring.

Batch invariance: a row's result must not depend on how many other rows share the matmul, or a request's text would
depend on the load. bf16 (oneDNN) and the int8/int4 kernels give the same row results for every batch size; fp32
(MKL) computes rows in tiles of 4 and a partial tile with another kernel, so fp32 pads the rows to a multiple of 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATIONS

INT4_GROUP = 32  # GGUF's quantisation blocks are 32 wide too
FP32_ROW_TILE = 4
QUANT_CHUNK_ROWS = 8192


class Int8Linear(nn.Module):
    """Symmetric per-output-channel int8 weights: w ≈ q * scale."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,) in the compute dtype
        self.out_features = qweight.shape[0]

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        qweight = torch.empty(weight.shape, dtype=torch.int8)  # (N, K)
        scale = torch.empty(weight.shape[0])  # (N,)
        for lo in range(0, weight.shape[0], QUANT_CHUNK_ROWS):  # in slices: no float32 copy of a 262k-row head
            w = weight[lo : lo + QUANT_CHUNK_ROWS].float()
            scale[lo : lo + len(w)] = s = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            qweight[lo : lo + len(w)] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(qweight, scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scale)
        return out.reshape(*shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Embedding rows read from the tied int8 LM head (row = q[id] * scale[id]): no second, full-precision table.

    The head's tensors are shared, not registered again, so a state dict holds them once (under lm_head).
    Effect on scoring (bench/scoring_drift.py): mean |Δ logprob| vs float32 0.079 → 0.087 nats per token.
    """

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self._head = [head]  # in a list: not a submodule, so its tensors are not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        return head.qweight[ids].to(head.scale.dtype) * head.scale[ids, None]


class Int4Linear(nn.Module):
    """Asymmetric int4 weights in groups of 32 along the input dim: w ≈ (q - 8) * scale + zero."""

    def __init__(self, qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # torch's packed int4 layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (K / 32, N, 2)
        self.out_features = scales_and_zeros.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
        n, k = weight.shape
        groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)  # (N, G, 32)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        scales_and_zeros = torch.stack([scale, lo + 8.0 * scale], dim=-1).transpose(0, 1)  # (G, N, 2)
        return cls(torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros.contiguous().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), self.qweight, INT4_GROUP, self.scales_and_zeros
        )
        return out.reshape(*shape[:-1], self.out_features)


class RowTiledLinear(nn.Module):
    """A plain linear layer that pads its rows to a multiple of FP32_ROW_TILE (fp32 batch invariance)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        if n % FP32_ROW_TILE:
            rows = torch.cat([rows, rows.new_zeros(FP32_ROW_TILE - n % FP32_ROW_TILE, shape[-1])])
        return F.linear(rows, self.weight)[:n].reshape(*shape[:-1], self.weight.shape[0])


def make_linear(weight: torch.Tensor, quantization: str) -> nn.Module:
    if quantization == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return Int4Linear.quantize(weight, weight.dtype)
    if quantization in ("int8", "int4"):  # int4 needs whole groups along the input dim; int8 otherwise
        return Int8Linear.quantize(weight, weight.dtype)
    if quantization == "none":
        return RowTiledLinear(weight)
    raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")


def prepare_linears(model: nn.Module, quantization: str) -> None:
    """Swap every bias-free nn.Linear for the engine's kind, and give a tied LM head its own module.

    A tied int8 head also serves the embedding lookups (Int8Embedding), so the full-precision table is dropped.
    Idempotent: a prepared model has no nn.Linear left and its head set.
    """
    dtype = model.get_submodule("model.norm").weight.dtype
    if quantization == "none" and dtype != torch.float32:
        return  # plain bf16 layers are already batch-invariant
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(parent, name, make_linear(child.weight.data, quantization))
    if getattr(model, "lm_head", None) is None:  # tied: the head gets its own module
        model.lm_head = make_linear(model.get_submodule("model.embed_tokens").weight.data, quantization)
        _look_up_in_int8_head(model)


def adopt_prepared(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Give a freshly built (meta) model the quantised modules that a saved prepared state dict was taken from."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            key = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and f"{key}.qweight" in state_dict:
                setattr(parent, name, _prepared_linear(key, state_dict))
    if getattr(model, "lm_head", None) is None and "lm_head.qweight" in state_dict:  # a tied head, quantised
        model.lm_head = _prepared_linear("lm_head", state_dict)
        _look_up_in_int8_head(model)


def _look_up_in_int8_head(model: nn.Module) -> None:
    """A tied int8 head also serves the embedding lookups; the full-precision table goes."""
    if isinstance(model.lm_head, Int8Linear):
        model.model.embed_tokens = Int8Embedding(model.lm_head)


def _prepared_linear(key: str, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    if f"{key}.scale" in state_dict:
        return Int8Linear(state_dict[f"{key}.qweight"], state_dict[f"{key}.scale"])
    return Int4Linear(state_dict[f"{key}.qweight"], state_dict[f"{key}.scales_and_zeros"])
