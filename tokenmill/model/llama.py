"""Llama-style decoders (Llama, Mistral) in plain PyTorch, with Hugging Face parameter names.

Per layer: RMSNorm → attention (rotary, grouped KV heads, optional sliding window) → residual, RMSNorm → SiLU-gated
MLP → residual. The LM head is its own matrix unless the checkpoint ties it to the embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.causal_lm import CausalLM, DecoderModel, KVCache, Rope
from tokenmill.model.layers import RMSNorm, Rotary, apply_rotary
from tokenmill.model.model_config import ModelConfig


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

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(DecoderModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaDecoderLayer, norm_offset=0.0)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)


class LlamaForCausalLM(CausalLM):
    model: LlamaModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        return [self.model.rope(positions, dtype)] * len(self.model.layers)  # every layer: the one base
