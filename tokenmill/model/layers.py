"""Building blocks shared by the architectures: RMSNorm, rotary embedding, attention over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) (`offset=1.0`); Llama by w."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding in the "rotate half" layout Hugging Face checkpoints use.

    The frequencies are recomputed per call (head_dim / 2 numbers) rather than kept as a buffer, so a model built on
    the meta device and filled by load_state_dict needs nothing re-initialised.
    """

    def __init__(self, head_dim: int, base: float, scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.base, self.scaling_factor = head_dim, base, scaling_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.base**exponents) / self.scaling_factor  # (head_dim / 2,)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the flat batch and in the paged cache. Built by the runner, read by attention.

    The step's T tokens are laid out sequence after sequence; sequence i owns `query_lens[i]` of them, which are the
    last positions of its `context_lens[i]`-long context. `kv_slots[i]` lists the cache slot of every position of that
    context (block table expanded), so attention gathers exactly the sequence's own keys and values.
    """

    slot_mapping: torch.Tensor  # (T,) cache slot each new token's K/V is written to
    query_lens: list[int]
    context_lens: list[int]
    kv_slots: list[torch.Tensor]  # per sequence (context_len,)
    # Decode fast path (every query_len == 1): all sequences' slots padded to one rectangle.
    decode_slots: torch.Tensor | None = None  # (B, L_max)
    decode_context_lens: torch.Tensor | None = None  # (B,)

    @property
    def is_decode(self) -> bool:
        return self.decode_slots is not None


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask (optionally sliding-window) for query positions (..., Q) against key positions (..., K)."""
    delta = q_pos[..., :, None] - k_pos[..., None, :]  # (..., Q, K)
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    return allowed


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (num_slots, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each sequence's queries over its own cached context."""
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.is_decode:
        return _decode_attention(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(q)
    start = 0
    for q_len, ctx_len, slots in zip(meta.query_lens, meta.context_lens, meta.kv_slots):
        end = start + q_len
        keys, values = k_cache[slots], v_cache[slots]  # (L, Hkv, D)
        q_pos = torch.arange(ctx_len - q_len, ctx_len)
        mask = _window_mask(q_pos, torch.arange(ctx_len), window)  # (Q, L)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # (Hq, Q, D)
            keys.transpose(0, 1),  # (Hkv, L, D)
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


def _decode_attention(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    assert meta.decode_slots is not None and meta.decode_context_lens is not None
    keys = k_cache[meta.decode_slots].transpose(1, 2)  # (B, Hkv, L, D)
    values = v_cache[meta.decode_slots].transpose(1, 2)
    ctx = meta.decode_context_lens
    k_pos = torch.arange(meta.decode_slots.shape[1])
    mask = _window_mask((ctx - 1)[:, None], k_pos[None, :].expand(len(ctx), -1), window)  # (B, 1, L)
    mask &= k_pos[None, None, :] < ctx[:, None, None]  # padding beyond each sequence's context
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # (B, Hq, 1, D)
        keys,
        values,
        attn_mask=mask[:, None, :, :],  # (B, 1, 1, L)
        scale=scale,
        enable_gqa=True,
    )
    return o[:, :, 0, :]  # (B, Hq, D)
