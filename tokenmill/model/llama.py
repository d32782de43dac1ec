"""Llama-style decoders (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3) in plain PyTorch, with Hugging Face names.

Per layer: RMSNorm → attention (rotary, grouped KV heads, optional sliding window) → residual, RMSNorm → SiLU-gated
MLP → residual. The LM head is its own matrix unless the checkpoint ties it to the embedding. What the family's
members add: Qwen2's q/k/v biases, Qwen3's RMSNorm on each q and k head before the rotary, Llama 3's and Phi-3's
rotary scaling (Rotary). q/k/v and gate/up are held stacked (one matmul each), as Phi-3's checkpoints already are.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.c_layer import CLayer, layer_plan, plannable
from tokenmill.model.causal_lm import KVCache, Rope, SingleRopeCausalLM, SingleRopeModel
from tokenmill.model.layers import RMSNorm, apply_rotary, silu_mul
from tokenmill.model.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.scale = cfg.attn_scale
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)  # q, k, v stacked
        # a checkpoint's biases sit beside the bias-free linear (registry.build_model), so every linear kind serves
        self.qkv_proj_bias = nn.Parameter(torch.zeros(q_size + 2 * kv_size)) if cfg.attention_bias else None
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.o_proj_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.output_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = biased(self.qkv_proj(x), self.qkv_proj_bias)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)  # (T, Hq, D)
        return biased(self.o_proj(out.reshape(t, self.num_heads * d)), self.o_proj_bias)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # stacked
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(2 * cfg.intermediate_size)) if cfg.mlp_bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return biased(
            self.down_proj(silu_mul(biased(self.gate_up_proj(x), self.gate_up_proj_bias))), self.down_proj_bias
        )


def biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class LlamaDecoderLayer(CLayer, nn.Module):
    """bf16 on a file's GGUF blocks: the whole layer in one C call (kernels/decoder_layer.c's llama_layer) where the
    kernels are built and the layer has no q/k norms and no biases but q/k/v's (model/c_layer.py)."""

    c_kernel = "llama_layer"

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        out = self.c_call(x, rope, kv_cache, meta)
        if out is not None:
            return out
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _build_plan(self) -> ops.DecoderLayerPlan | None:
        attn, mlp = self.self_attn, self.mlp
        extras = (attn.q_norm, attn.o_proj_bias, mlp.gate_up_proj_bias, mlp.down_proj_bias)
        if any(e is not None for e in extras) or not plannable(attn, mlp):
            return None
        bias = attn.qkv_proj_bias
        return layer_plan(
            attn,
            mlp,
            eps=self.input_layernorm.eps,
            input_norm=self.input_layernorm.factor.data_ptr(),
            post_attention_norm=self.post_attention_layernorm.factor.data_ptr(),
            qkv_bias=None if bias is None else self._bf16_bias(bias),
        )

    def _bf16_bias(self, bias: torch.Tensor) -> int | None:
        """q/k/v's bias as the C layer adds it: bf16, as the module adds it to the bf16 product."""
        self._qkv_bias = bias.detach().to(torch.bfloat16).contiguous()  # kept alive as long as the plan
        return int(self._qkv_bias.data_ptr())


class LlamaModel(SingleRopeModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaDecoderLayer, norm_offset=0.0)


class LlamaForCausalLM(SingleRopeCausalLM):
    STACKED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    ACTIVATION_KERNEL: ClassVar[str | None] = "silu_mul"
    model: LlamaModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
