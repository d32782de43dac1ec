"""Random LoRA adapters for a model, for the LoRA benchmark: a PEFT directory (what tokenmill serves) and the same
update as a GGUF LoRA (what llama-server serves: llama.cpp's convert_lora_to_gguf.py's names and metadata, the Llama
q/k rows of B permuted as the base file's are). Every linear of every decoder layer is adapted, at the given rank;
the values are small and random, so that the outputs change and stay sensible."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from tokenmill.model.loading.gguf_convert import gguf_block_name
from tokenmill.model.lora import projection_widths
from tokenmill.model.model_config import ModelConfig

STD_A, STD_B = 0.02, 0.02  # the random A's and B's spread: scale · B·A is a ~1% change of a unit-scale weight


def projections(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adapted projection of a layer (the checkpoint's names) → (input, output) width."""
    widths = projection_widths(config)
    mlp = ("c_fc", "c_proj") if config.architecture == "starcoder2" else ("gate_proj", "up_proj", "down_proj")
    return {
        **{f"self_attn.{name}": widths[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"mlp.{name}": widths[name] for name in mlp},
    }


def write_random_adapter(directory: Path, config: ModelConfig, rank: int, seed: int, alpha: float = 32.0) -> Path:
    """A PEFT adapter directory of rank `rank` over every linear of `config`'s layers."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name, (k, n) in projections(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=generator) * STD_A
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=generator) * STD_B
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted({name.rpartition(".")[2] for name in projections(config)}),
        "base_model_name_or_path": config.name or config.architecture,
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return directory


def write_gguf_lora(path: Path, directory: Path, config: ModelConfig) -> Path:
    """The PEFT adapter in `directory` as a GGUF LoRA for a base of `config`'s architecture (F32 tensors)."""
    from safetensors.torch import load_file

    settings = json.loads((directory / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(path), config.architecture)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(settings["lora_alpha"]))
    for key, value in sorted(load_file(str(directory / "adapter_model.safetensors")).items()):
        module, half = key.removeprefix("base_model.model.").split(".lora_")
        matrix = value.float().numpy()
        if half.startswith("B") and config.architecture == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
            matrix = _llama_cpp_permute(matrix, heads)
        w.add_tensor(f"{gguf_block_name(module, config.architecture)}.weight.lora_{half[0].lower()}", matrix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's `permute` of Llama's q/k rows (gguf_convert.unpermute_rotary undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
