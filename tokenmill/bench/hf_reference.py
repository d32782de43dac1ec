"""The same weights in Hugging Face `transformers`' Gemma 3: the reference our model is tested and benchmarked against.

Needs `transformers` (a test and bench dependency, not a serving one).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.model_config import ModelConfig, UnsupportedModelError


def transformers_gemma3(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], attn_implementation: str = "eager"
) -> nn.Module:
    """transformers' Gemma3ForCausalLM holding our loader's (Hugging Face-named) weights, tied head, eval mode."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if cfg.architecture != "gemma3":
        raise UnsupportedModelError(f"the transformers reference maps Gemma 3 only, not {cfg.architecture}")
    hf_config = Gemma3TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        # PretrainedConfig takes it through **kwargs; Gemma3TextConfig's typed signature does not list it
        attn_implementation=attn_implementation,  # type: ignore[call-arg]
    )
    model = Gemma3ForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"weights do not fit transformers' Gemma 3: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
