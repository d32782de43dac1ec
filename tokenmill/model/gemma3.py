"""Gemma 3 (text) and Gemma 2 in plain PyTorch, with Hugging Face parameter names so checkpoints load as they are.

Per layer: sliding-window (local, rope base 10k) or global attention (rope base 1M), q/k RMSNorm, norms before and
after both attention and MLP, GELU-tanh gated MLP. Embeddings are scaled by sqrt(hidden); the LM head is tied.
Gemma 2 is the same but for: no q/k norms, one rope base, sliding and global layers alternating, and soft-capped
attention scores and logits (cap * tanh(x / cap)).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.c_layer import CLayer, layer_plan, plannable
from tokenmill.model.causal_lm import CausalLM, DecoderModel, KVCache, Rope
from tokenmill.model.layers import RMSNorm, Rotary, apply_rotary, gelu_mul, norm_rotary
from tokenmill.model.model_config import ModelConfig


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_logit_softcapping
        self.eps = cfg.rms_norm_eps
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)  # q, k, v stacked: one matmul
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.architecture == "gemma3"
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0) if self.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0) if self.qk_norm else None
        self._qk_factor: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t, heads, d = x.shape[0], self.num_heads + self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : heads * d].view(t, heads, d)  # q heads then k heads: normed and rotated together
        qk = norm_rotary(qk, self.qk_factor, self.eps, *rope) if self.qk_norm else apply_rotary(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, heads * d :].view(t, self.num_kv_heads, d)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * d))

    @property
    def qk_factor(self) -> torch.Tensor:
        """(Hq + Hkv, D) float32: each q head's and k head's RMSNorm factor, stacked like the heads."""
        if self._qk_factor is None:
            assert self.q_norm is not None and self.k_norm is not None
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


class Gemma3DecoderLayer(CLayer, nn.Module):
    """bf16 on the file's GGUF blocks: the whole layer in one C call (kernels/decoder_layer.c's gemma3_layer) where
    the kernels are built (model/c_layer.py)."""

    c_kernel = "gemma3_layer"

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

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        out = self.c_call(x, rope, kv_cache, meta)
        if out is not None:
            return out
        x = self.post_attention_layernorm.add_to(x, self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x)))

    def _build_plan(self) -> ops.DecoderLayerPlan | None:
        attn, mlp = self.self_attn, self.mlp
        if not (attn.qk_norm and not attn.softcap and plannable(attn, mlp)):
            return None
        return layer_plan(
            attn,
            mlp,
            eps=attn.eps,
            input_norm=self.input_layernorm.factor.data_ptr(),
            post_attention_norm=self.post_attention_layernorm.factor.data_ptr(),
            pre_feedforward_norm=self.pre_feedforward_layernorm.factor.data_ptr(),
            post_feedforward_norm=self.post_feedforward_layernorm.factor.data_ptr(),
            qk_factor=attn.qk_factor.data_ptr(),
        )


class Gemma3Model(DecoderModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Gemma3DecoderLayer, norm_offset=1.0)
        self.rope_global = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor)
        self.rope_local = Rotary(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta)
        self.embed_scale = cfg.hidden_size**0.5


class Gemma3ForCausalLM(CausalLM):
    STACKED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    ACTIVATION_KERNEL: ClassVar[str | None] = "gelu_mul"
    model: Gemma3Model

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = Gemma3Model(cfg)
        self.lm_head = None  # always tied

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)  # (T, H)
        return x * torch.tensor(self.model.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as HF does

    def embed_scale(self) -> float | None:
        return self.model.embed_scale

    def layer_rotaries(self) -> list[Rotary]:
        return [self.model.rope_local if layer.is_sliding else self.model.rope_global for layer in self.model.layers]
