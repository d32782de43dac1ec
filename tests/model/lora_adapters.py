"""LoRA adapters for the tiny test models, made with `peft` itself: random A and B (PEFT starts B at zero, which would
change nothing), saved as PEFT saves them, and written as a GGUF LoRA the way llama.cpp's convert_lora_to_gguf.py
writes one (the base file's tensor names with .lora_a / .lora_b, Llama's q/k rows of B permuted, the alpha as
metadata)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import load_file

from tests.gguf_writer import tensor_name
from tests.model.families import SIZES, _llama_cpp_permute

# every linear of a decoder layer, under the names each family's checkpoint gives them
TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
}
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: torch.nn.Module,
    family: str,
    directory: Path,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    merge: bool = True,
    **options: Any,
) -> torch.nn.Module | None:
    """A random LoRA of `base` (a transformers model; left unchanged) saved as a PEFT directory; returns base + the
    adapter merged, in float32, as the reference to compare with (`merge`; else None). `options`: LoraConfig's."""
    import copy

    import peft

    config = peft.LoraConfig(
        **{"r": rank, "lora_alpha": alpha, "target_modules": TARGETS.get(family, DEFAULT_TARGETS), **options}
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    model.save_pretrained(directory)
    return model.merge_and_unload().eval() if merge else None


def write_gguf_lora(path: Path, directory: Path, arch: str, alpha: float) -> Path:
    """The PEFT adapter in `directory` as llama.cpp's converter writes it for a base of `arch`."""
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, value in sorted(tensors.items()):
        module, half = key.removeprefix("base_model.model.").split(".lora_")
        matrix = value.float().numpy()
        if half.startswith("B") and arch == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = SIZES["num_attention_heads"] if module.endswith("q_proj") else SIZES["num_key_value_heads"]
            matrix = _llama_cpp_permute(matrix, heads)
        w.add_tensor(f"{tensor_name(module + '.weight', arch)}.lora_{half[0].lower()}", matrix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
