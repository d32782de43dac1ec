"""Architecture name → nn.Module class, and building a model straight from a loaded state dict."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.gguf_linear import GgufWeight, adopt_gguf
from tokenmill.model.linear import adopt_prepared
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.model_config import ModelConfig, UnsupportedModelError
from tokenmill.model.starcoder2 import Starcoder2ForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "gemma3": Gemma3ForCausalLM,
    "gemma2": Gemma3ForCausalLM,  # the same layers without q/k norms, with soft-capping (gemma3.py)
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    prepared: bool = False,
    quantized: dict[str, GgufWeight] | None = None,
    greedy_head: bool = False,
) -> CausalLM:
    """Builds on the meta device (no random init of 268 M parameters) and adopts the loaded tensors as they are.

    `prepared`: the state dict was saved from a prepared model (quantised linears), whose module kinds it restores.
    `quantized`: weights kept as a GGUF file's blocks, which get GgufLinear / GgufEmbedding modules.
    `greedy_head`: a Q8_0 head of those also keeps a 6-bit copy for lone greedy rows (adopt_gguf).
    """
    model = model_skeleton(cfg)
    cls = type(model)
    if prepared:
        adopt_prepared(model, state_dict)
    entries: dict[str, torch.Tensor] = {}
    if quantized:
        dtype = state_dict["model.norm.weight"].dtype
        entries, floats = adopt_gguf(model, quantized, cls.STACKED_PROJECTIONS, dtype, greedy_head)
        state_dict = {**state_dict, **floats}
    stacked = biases_beside_linears(stack_projections(state_dict, cls.STACKED_PROJECTIONS))
    model.load_state_dict({**stacked, **entries}, assign=True, strict=True)
    return model.eval()


def model_skeleton(cfg: ModelConfig) -> CausalLM:
    """The model's modules on the meta device, with no tensors behind them yet."""
    cls = ARCHITECTURES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no implementation for architecture {cfg.architecture!r}")
    with torch.device("meta"), _no_weight_init():
        return cls(cfg)


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Module constructors skip their random initialisation (the loaded tensors replace it anyway).

    On the meta device that initialisation is free of work but not of cost: its first call imports torch's reference
    decompositions, a large part of a cached start (docs/decisions/0017-startup-overlap.md).
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def stack_projections(
    state_dict: dict[str, torch.Tensor], stacked: dict[str, tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """Concatenates a checkpoint's separate projections (e.g. q/k/v_proj) into the model's stacked one (qkv_proj),
    weights and biases alike.

    Rows of a linear layer are independent outputs, and the int8/int4 schemes quantise per output row, so a stacked
    layer computes exactly what the separate ones did, in one matmul call instead of several.
    """
    out = dict(state_dict)
    for name, parts in stacked.items():
        for kind in ("weight", "bias"):
            for key in [k for k in state_dict if k.endswith(f".{parts[0]}.{kind}")]:
                prefix = key[: -len(f"{parts[0]}.{kind}")]
                out[f"{prefix}{name}.{kind}"] = torch.cat([out.pop(f"{prefix}{p}.{kind}") for p in parts])
    return out


def biases_beside_linears(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A linear's checkpoint bias `X.bias` → the model's `X_bias`, a parameter beside the bias-free linear `X`.

    The engine's linear kinds (int8 tiles, GGUF blocks, bf16 rows) carry no bias; the module adds it after the
    product, so each of them serves a checkpoint with biases unchanged. Norm biases (`..norm.bias`) stay where they are.
    """
    return {(f"{key[: -len('.bias')]}_bias" if _linear_bias(key) else key): value for key, value in state_dict.items()}


def _linear_bias(key: str) -> bool:
    module, _, kind = key.rpartition(".")
    return kind == "bias" and "norm" not in module.rpartition(".")[2]
