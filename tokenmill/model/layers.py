"""Building blocks shared by the architectures: RMSNorm and the rotary embedding (attention: attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.model_config import RopeScaling


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) in float32 (`offset=1.0`); Llama by w after the cast.

    The float32 factor (Gemma's 1 + w, Llama's w) is computed once, on first use after loading (`factor`); in bfloat16
    the norm is one call of a fused C kernel (kernels/fused.c), else torch's rms_norm: a decode step runs over a hundred
    of these norms.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self._factor: torch.Tensor | None = None

    @property
    def factor(self) -> torch.Tensor:
        """offset + weight in float32: what the normalised rows are multiplied by."""
        if self._factor is None:
            self._factor = self.offset + self.weight.detach().float()
        return self._factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            if ops.usable(x):
                return ops.rms_norm(x, self.factor, self.eps)
            return F.rms_norm(x.float(), self.weight.shape, self.factor, self.eps).to(x.dtype)
        if ops.usable(x) and self.weight.dtype == x.dtype:  # the weight's bf16 values, as float32 (exact)
            return ops.weighted_rms_norm(x, self.factor, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_to(self, residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """residual + self(y): Gemma's norm after each sublayer, added back to the residual stream."""
        if self.offset and ops.usable(y):
            return ops.add_rms_norm(residual, y, self.factor, self.eps)
        return residual + self(y)


class Rotary(nn.Module):
    """Rotary position embedding in the "rotate half" layout Hugging Face checkpoints use.

    The frequencies are computed from the config, not kept as a buffer, so a model built on the meta device and filled
    by load_state_dict needs nothing re-initialised. `scaling`: per-frequency divisors (Llama 3, Phi-3's longrope; see
    RopeScaling), on top of the linear `scaling_factor`. The (cos, signed sin) of every position up to the furthest
    asked for are kept per dtype, grown by doubling, and a step's rows are picked from them: each position's values
    are computed elementwise, so picking gives the same numbers as computing them for the step's positions alone.
    """

    def __init__(
        self, head_dim: int, base: float, scaling_factor: float = 1.0, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.base, self.scaling_factor, self.scaling = head_dim, base, scaling_factor, scaling
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, divisors: tuple[float, ...] | None = None) -> torch.Tensor:
        """(head_dim / 2,) float32: the rotation of each pair of dimensions per position."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.base**exponents) / self.scaling_factor
        return inv_freq if divisors is None else inv_freq / torch.tensor(divisors, dtype=torch.float32)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (cos, signed sin), each (T, 1, head_dim): the sin's first half negated, as `apply_rotary` wants it."""
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 0, dtype)
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def tables(self, furthest: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept (cos, signed sin) of every position up to at least `furthest` (excluded), each (rows, head_dim) in
        `dtype`; grown by doubling where they fall short (a grown table is a new tensor)."""
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or sin is None or cos.shape[0] < furthest:
            size = max(furthest, 2 * cos.shape[0] if cos is not None else 256)
            cos, sin = self._tables[dtype] = self.table(torch.arange(size), dtype)
        return cos, sin

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) of `positions`, each (T, head_dim) in `dtype`."""
        scaling = self.scaling
        divisors = scaling.divisors if scaling is not None else None
        freqs = positions.float()[:, None] * self.inv_freq(divisors)[None, :]  # (T, head_dim / 2)
        if scaling is not None and scaling.long_divisors is not None:
            long = positions.float()[:, None] * self.inv_freq(scaling.long_divisors)[None, :]
            freqs = torch.where(positions[:, None] >= (scaling.original_max_positions or 0), long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        sign = torch.ones(self.head_dim)
        sign[: self.head_dim // 2] = -1.0
        cos, sin = emb.cos(), emb.sin()
        if scaling is not None and scaling.attention_scale != 1.0:
            cos, sin = cos * scaling.attention_scale, sin * scaling.attention_scale
        return cos.to(dtype), (sin * sign).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim). HF's x·cos + rotate_half(x)·sin, where rotate_half(x) = (-x₂, x₁): the halves swapped
    by one roll and the minus carried by the signed sin, in three ops instead of seven (this runs twice per layer);
    in bf16 one C call with the same roundings (fused.c's rotary)."""
    if ops.usable(x) and cos.dtype == x.dtype and x.dim() == 3:
        return ops.rotary(x, cos[:, 0], signed_sin[:, 0])
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


def norm_rotary(
    x: torch.Tensor, factor: torch.Tensor, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """x: (T, H, D). Each head RMS-normed with its row of `factor` ((H, D) float32), then rotated (Gemma's q/k)."""
    if ops.usable(x) and x.shape[-1] <= ops.MAX_HEAD_DIM:
        return ops.norm_rotary(x, factor, cos[:, 0], signed_sin[:, 0], eps)
    normed = (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * factor).to(x.dtype)
    return apply_rotary(normed, cos, signed_sin)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) → gelu_tanh(gate) · up, (T, F): Gemma's gated MLP activation (bf16: one C pass, ops.gelu_mul)."""
    if gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0 and ops.usable(gate_up) and ops.gelu_mul_available():
        return ops.gelu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) → silu(gate) · up, (T, F): Llama's gated MLP activation (bf16: one C pass, ops.silu_mul)."""
    if gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0 and ops.usable(gate_up) and ops.silu_mul_available():
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
