"""The engine's linear layers: weight-only quantised for fast CPU decode, or fp32 in fixed row chunks (batch-invariant).

A decode step reads every weight once per token, so on a memory-bound CPU the step time follows the weights' bytes:
int8 halves bf16's. With bf16 activations on a CPU with AVX-512 VNNI or AVX2, int8 layers run our own kernel
(TiledInt8Linear, int8_matmul.c: int16 activations against int8 weights in integer dot products, where torch's kernel
converts every weight to float; docs/decisions/0005-int8-for-hugging-face.md measures both); otherwise torch's CPU kernels do
the matmul (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`). Quantising changes logits, so the unquantised
modes stay for scoring.

Batch invariance: a row's result must not depend on how many other rows share the matmul, or a request's text would
depend on the load. bf16 (oneDNN), torch's int8/int4 kernels and ours give the same row results for every batch size;
fp32 (MKL) picks its kernel and blocking by the row count (on an Intel Xeon, row 0 of 8 rows at 128 → 512 differed
from row 0 of 4), so fp32 rows are multiplied FP32_ROW_CHUNK at a time, the last chunk padded: every call has the same
shape, and within one a row's result does not depend on the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATIONS
from tokenmill.kernels import ops
from tokenmill.model.gguf_linear import GgufLinear

INT4_GROUP = 32  # GGUF's quantisation blocks are 32 wide too
FP32_ROW_CHUNK = 8  # rows per fp32 call: a decode step pads to 8 rows, a prefill of T tokens makes T / 8 calls
QUANT_CHUNK_ROWS = 8192  # a multiple of INT8_TILE
INT8_TILE = ops.INT8_MATMUL_TILE  # int8_matmul.c's output columns per tile (kernels.h)
INT8_TILED_K = ops.INT8_MATMUL_K_MULTIPLE  # its input width must be a multiple of this


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) → symmetric per-output-row int8 (N, K) and float32 scales (N,): w ≈ q * scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def tile_int8(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 → int8_matmul.c's tiles, (ceil(N / 64), K / 2, 64, 2); the last tile's missing columns are zeros."""
    n, k = q.shape
    if n % INT8_TILE:
        q = torch.cat([q, q.new_zeros(INT8_TILE - n % INT8_TILE, k)])
    return q.view(-1, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class Int8Linear(nn.Module):
    """Symmetric per-output-channel int8 weights: w ≈ q * scale."""

    qweight: torch.Tensor
    scale: torch.Tensor

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
            qweight[lo : lo + QUANT_CHUNK_ROWS], scale[lo : lo + QUANT_CHUNK_ROWS] = quantize_int8(
                weight[lo : lo + QUANT_CHUNK_ROWS]
            )
        return cls(qweight, scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scale)
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.scale.dtype) * self.scale[ids, None]


class TiledInt8Linear(nn.Module):
    """The same int8 weights in int8_matmul.c's tile layout, multiplied by that kernel (bf16 activations only)."""

    tiles: torch.Tensor
    scale: torch.Tensor

    def __init__(self, tiles: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles)  # (ceil(N / 64), K / 2, 64, 2) int8, see int8_matmul.c
        self.register_buffer("scale", scale)  # (N,) float32
        self.out_features = scale.shape[0]

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.shape[1] % INT8_TILED_K == 0 and ops.int8_matmul_available()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> TiledInt8Linear:
        n, k = weight.shape
        tiles = torch.zeros(-(-n // INT8_TILE), k // 2, INT8_TILE, 2, dtype=torch.int8)
        scale = torch.empty(n)
        for lo in range(0, n, QUANT_CHUNK_ROWS):  # in slices: no float32 or untiled copy of a 262k-row head
            q, scale[lo : lo + QUANT_CHUNK_ROWS] = quantize_int8(weight[lo : lo + QUANT_CHUNK_ROWS])
            chunk = tile_int8(q)
            tiles[lo // INT8_TILE : lo // INT8_TILE + len(chunk)] = chunk
        return cls(tiles, scale)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        shape = x.shape
        out = ops.int8_matmul(x.reshape(-1, shape[-1]), self.tiles, self.scale, self.out_features, out_dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.tiles[ids // INT8_TILE, :, ids % INT8_TILE, :].reshape(len(ids), -1)  # (len(ids), K)
        return (q.float() * self.scale[ids, None]).to(torch.bfloat16)


class Int8Embedding(nn.Module):
    """Embedding rows read from the tied int8 LM head (row = q[id] * scale[id]): no second, full-precision table.

    The head's tensors are shared, not registered again, so a state dict holds them once (under lm_head).
    Effect on scoring (scripts/scoring_drift.py): mean |Δ logprob| vs float32 0.079 → 0.087 nats per token.
    """

    def __init__(self, head: Int8Linear | TiledInt8Linear) -> None:
        super().__init__()
        self._head = [head]  # in a list: not a submodule, so its tensors are not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._head[0].dequantized_rows(flat).reshape(*ids.shape, -1)


class Int4Linear(nn.Module):
    """Asymmetric int4 weights in groups of 32 along the input dim: w ≈ (q - 8) * scale + zero."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

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
    """A plain linear layer computed FP32_ROW_CHUNK rows at a time (fp32 batch invariance)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_linear(x, self.weight)


def chunked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), FP32_ROW_CHUNK rows per call with the last chunk zero-padded, so that a row's result
    cannot depend on how many rows share the product."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    n = rows.shape[0]
    if pad := -n % FP32_ROW_CHUNK:
        rows = torch.cat([rows, rows.new_zeros(pad, shape[-1])])
    chunks = [F.linear(chunk, weight) for chunk in rows.split(FP32_ROW_CHUNK)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out[:n].reshape(*shape[:-1], weight.shape[0])


def float32_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) in float32 (logits): TiledInt8Linear and GgufLinear write float32 themselves, unrounded; others'
    outputs are cast."""
    if isinstance(layer, TiledInt8Linear | GgufLinear):
        return layer(x, out_dtype=torch.float32)
    return layer(x).float()


def make_linear(weight: torch.Tensor, quantization: str) -> nn.Module:
    if quantization == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return Int4Linear.quantize(weight, weight.dtype)
    if quantization in ("int8", "gguf") and TiledInt8Linear.fits(weight):  # gguf: a weight the file holds as floats
        return TiledInt8Linear.quantize(weight)
    if quantization in ("int8", "gguf", "int4"):  # int4 needs whole groups along the input dim; int8 otherwise
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
        model.lm_head = make_linear(_embedding(model).weight.data, quantization)
        _look_up_in_int8_head(model)


def adopt_prepared(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Give a freshly built (meta) model the quantised modules that a saved prepared state dict was taken from."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            key = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and _is_prepared(key, state_dict):
                setattr(parent, name, _prepared_linear(key, state_dict))
    if getattr(model, "lm_head", None) is None and _is_prepared("lm_head", state_dict):  # a tied head, quantised
        model.lm_head = _prepared_linear("lm_head", state_dict)
        _look_up_in_int8_head(model)


def _look_up_in_int8_head(model: nn.Module) -> None:
    """A tied int8 head also serves the embedding lookups; the full-precision table goes."""
    if isinstance(model.lm_head, Int8Linear | TiledInt8Linear):
        model.get_submodule("model").embed_tokens = Int8Embedding(model.lm_head)


def _embedding(model: nn.Module) -> nn.Embedding:
    embed = model.get_submodule("model.embed_tokens")
    if not isinstance(embed, nn.Embedding):
        raise TypeError(f"a tied LM head is made from the embedding table, not from {type(embed).__name__}")
    return embed


def prepared_layout(dtype: torch.dtype, quantization: str) -> str:
    """Names the layout prepare_linears gives int8 weights here, for the prepared-weights cache file's name."""
    tiled = quantization in ("int8", "gguf") and dtype == torch.bfloat16 and ops.int8_matmul_available()
    return "tiled" if tiled else "plain"


def _is_prepared(key: str, state_dict: dict[str, torch.Tensor]) -> bool:
    return f"{key}.qweight" in state_dict or f"{key}.tiles" in state_dict


def _prepared_linear(key: str, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    if f"{key}.tiles" in state_dict:
        return TiledInt8Linear(state_dict[f"{key}.tiles"], state_dict[f"{key}.scale"])
    if f"{key}.scale" in state_dict:
        return Int8Linear(state_dict[f"{key}.qweight"], state_dict[f"{key}.scale"])
    return Int4Linear(state_dict[f"{key}.qweight"], state_dict[f"{key}.scales_and_zeros"])
