"""Architecture name → nn.Module class, and building a model straight from a loaded state dict."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.model_config import ModelConfig, UnsupportedModelError

ARCHITECTURES: dict[str, type[nn.Module]] = {"gemma3": Gemma3ForCausalLM, "llama": LlamaForCausalLM}


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """Builds on the meta device (no random init of 268 M parameters) and adopts the loaded tensors as they are."""
    cls = ARCHITECTURES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no implementation for architecture {cfg.architecture!r}")
    with torch.device("meta"):
        model = cls(cfg)
    model.load_state_dict(state_dict, assign=True, strict=True)
    return model.eval()
