"""StarCoder2 in plain PyTorch, with Hugging Face parameter names.

Llama's attention (rotary, grouped KV heads, optional sliding window) with biases on q/k/v and the output, but layer
norms with biases in place of RMSNorm, and a plain GELU-tanh MLP (c_fc → gelu → c_proj, biases) in place of a gated
one. The LM head is tied to the embedding unless the checkpoint says otherwise.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.causal_lm import KVCache, Rope, SingleRopeCausalLM, SingleRopeModel
from tokenmill.model.llama import LlamaAttention, biased
from tokenmill.model.model_config import ModelConfig


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # biases beside the bias-free linears, as in llama.py (registry.biases_beside_linears)
        self.c_fc_bias = nn.Parameter(torch.zeros(cfg.intermediate_size)) if cfg.mlp_bias else None
        self.c_proj_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(biased(self.c_fc(x), self.c_fc_bias), approximate="tanh")
        return biased(self.c_proj(hidden), self.c_proj_bias)


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = Starcoder2MLP(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerNorm(nn.LayerNorm):
    """Layer norm computed in float32 whatever the activations' dtype (as a bf16 checkpoint's norms should be)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps).to(
            x.dtype
        )


class Starcoder2Model(SingleRopeModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Starcoder2DecoderLayer, norm_offset=0.0)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]


class Starcoder2ForCausalLM(SingleRopeCausalLM):
    STACKED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    model: Starcoder2Model

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = Starcoder2Model(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
