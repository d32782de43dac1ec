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


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # each (num_slots, Hkv, D)
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each sequence's queries over its own cached context.

    Sequences are attended one at a time, never padded into a batch: padding changes the reduction order, so a
    sequence's numbers would depend on its neighbours. This way a sequence computes the same values alone or under load.
    """
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    start = 0
    for q_len, ctx_len, slots in zip(meta.query_lens, meta.context_lens, meta.kv_slots):
        end = start + q_len
        attend(q[start:end], k_cache, v_cache, slots, ctx_len, scale, window, out=out[start:end])
        start = end
    return out


def attend(
    q: torch.Tensor,  # (Q, Hq, D): the last Q positions of a ctx_len-long context
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (ctx_len,)
    ctx_len: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,  # (Q, Hq, D), written in place
) -> None:
    """Each query row attends over exactly its own visible keys, one row at a time.

    A row's result then depends only on its own keys, never on how the prompt was split into chunks, on which prefix
    came from the cache, or on the batch: a masked or padded block changes the order of the float reductions.
    """
    first = ctx_len - q.shape[0]  # position of the first query
    base = max(0, first + 1 - window) if window is not None else 0  # no query sees a key before this position
    keys = k_cache[slots[base:]].transpose(0, 1)  # (Hkv, L - base, D): a sliding layer gathers only its window
    values = v_cache[slots[base:]].transpose(0, 1)
    for i in range(q.shape[0]):
        end = first + i + 1  # positions [lo, end) are visible to this query
        lo = max(0, end - window) if window is not None else 0
        o = F.scaled_dot_product_attention(
            q[i, :, None, :],  # (Hq, 1, D)
            keys[:, lo - base : end - base],
            values[:, lo - base : end - base],
            scale=scale,
            enable_gqa=True,
        )
        out[i] = o[:, 0, :]
