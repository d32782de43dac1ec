"""Llama-style decoders (Llama, Mistral) in plain PyTorch, with Hugging Face parameter names.

Per layer: RMSNorm → attention (rotary, grouped KV heads, optional sliding window) → residual, RMSNorm → SiLU-gated
MLP → residual. The LM head is its own matrix unless the checkpoint ties it to the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.dense import dense_metadata, empty_kv_caches
from tokenmill.model.layers import RMSNorm, Rotary, apply_rotary
from tokenmill.model.linear import float32_product
from tokenmill.model.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.scale = cfg.attn_scale
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        untied = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head: nn.Module | None = untied

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (T,) → final hidden states (T, hidden)."""
        x = self.model.embed_tokens(input_ids)  # (T, H)
        rope = self.model.rope(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, H) → float32 logits (N, V)."""
        if self.lm_head is not None:
            return float32_product(self.lm_head, hidden)
        return F.linear(hidden, self.lm_head_weight).float()

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of one sequence, with a throwaway cache (tests and scoring checks)."""
        t = input_ids.shape[0]
        caches = empty_kv_caches(self.config, t, self.model.norm.weight.dtype)
        hidden = self.forward(input_ids, torch.arange(t), caches, dense_metadata(t))
        return self.compute_logits(hidden)
