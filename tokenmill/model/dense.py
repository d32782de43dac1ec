"""A one-sequence, whole-prompt forward pass with a throwaway KV cache: for tests and reference comparisons."""

from __future__ import annotations

import torch

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.model_config import ModelConfig


def empty_kv_caches(cfg: ModelConfig, num_slots: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


def dense_metadata(num_tokens: int) -> AttentionMetadata:
    slots = torch.arange(num_tokens)
    return AttentionMetadata(slot_mapping=slots, query_lens=[num_tokens], context_lens=[num_tokens], kv_slots=[slots])
