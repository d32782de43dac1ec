"""Gemma 3 (text) in plain PyTorch, with Hugging Face parameter names so checkpoints load as they are.

Per layer: sliding-window (local, rope base 10k) or global attention (rope base 1M), q/k RMSNorm, norms before and
after both attention and MLP, GELU-tanh gated MLP. Embeddings are scaled by sqrt(hidden); the LM head is tied.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.dense import dense_metadata, empty_kv_caches
from tokenmill.model.layers import RMSNorm, Rotary, gelu_mul, norm_rotary
from tokenmill.model.linear import float32_product
from tokenmill.model.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.scale = cfg.attn_scale
        self.eps = cfg.rms_norm_eps
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)  # q, k, v stacked: one matmul
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self._qk_factor: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, heads, d = x.shape[0], self.num_heads + self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : heads * d].view(t, heads, d)  # q heads then k heads: normed and rotated together
        qk = norm_rotary(qk, self.qk_factor, self.eps, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, heads * d :].view(t, self.num_kv_heads, d)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * d))

    @property
    def qk_factor(self) -> torch.Tensor:
        """(Hq + Hkv, D) float32: each q head's and k head's RMSNorm factor, stacked like the heads."""
        if self._qk_factor is None:
            q, k = self.q_norm.factor, self.k_norm.factor
            self._qk_factor = torch.cat([q.expand(self.num_heads, -1), k.expand(self.num_kv_heads, -1)])
        return self._qk_factor


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # stacked: one matmul
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_sliding = cfg.is_sliding(layer)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.post_attention_layernorm.add_to(x, self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.rope_global = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
        self.rope_local = Rotary(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta)
        self.embed_scale = cfg.hidden_size**0.5


class Gemma3ForCausalLM(nn.Module):
    # checkpoint projections that the model holds stacked (one matmul each), in stacking order
    STACKED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head: nn.Module | None = None  # tied to the embedding unless replaced by a quantised copy

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # tied

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: (T,) → final hidden states (T, hidden)."""
        m = self.model
        x = m.embed_tokens(input_ids)  # (T, H)
        x = x * torch.tensor(m.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as HF does
        rope_global = m.rope_global(positions, x.dtype)
        rope_local = m.rope_local(positions, x.dtype)
        for layer, kv_cache in zip(m.layers, kv_caches):
            x = layer(x, rope_local if layer.is_sliding else rope_global, kv_cache, meta)
        return m.norm(x)

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
