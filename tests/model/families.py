"""Tiny random-weight models of each supported family, built with `transformers` itself and saved as a Hugging Face
directory, and the same weights written as a GGUF file the way llama.cpp's converter writes them (its tensor names,
Llama's q/k rows permuted, Phi-3's fused tensors, rope factors as tensors)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_writer import add_sizes, add_tokenizer, tensor_name, write_gguf_file
from tests.tiny_model import tiny_gguf_metadata, write_tokenizer_files

SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
HEAD_DIM = 16
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # with head_dim 16: short, blended and long wavelengths all occur
}
LONGROPE_ORIGINAL = 32  # Phi-3's longrope: short factors below this position, long ones from it on
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10_000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
    "original_max_position_embeddings": LONGROPE_ORIGINAL,
}


@dataclass(frozen=True)
class Family:
    name: str  # the test id
    model_type: str  # config.json's
    gguf_arch: str  # general.architecture in its GGUF files
    options: dict[str, Any]  # config fields beyond SIZES
    sliding_window: int | None = None


FAMILIES = [
    Family("llama", "llama", "llama", {"tie_word_embeddings": False}),
    Family("llama3", "llama", "llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    Family("mistral", "mistral", "llama", {"tie_word_embeddings": True, "sliding_window": 8}, sliding_window=8),
    Family("qwen2", "qwen2", "qwen2", {"tie_word_embeddings": True}),
    Family("qwen3", "qwen3", "qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
    Family(
        "phi3",
        "phi3",
        "phi3",
        {
            "tie_word_embeddings": False,
            "rope_parameters": LONGROPE,
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
        },
    ),
]
FAMILIES.append(
    Family(
        "gemma2",
        "gemma2",
        "gemma2",
        {
            "tie_word_embeddings": True,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "attn_logit_softcapping": 0.02,  # small enough to bite on a tiny random model's scores and logits
            "final_logit_softcapping": 0.5,
            "sliding_window": 8,
        },
        sliding_window=8,
    )
)
FAMILIES.append(Family("starcoder2", "starcoder2", "starcoder2", {"tie_word_embeddings": True, "norm_epsilon": 1e-5}))
BY_NAME = {f.name: f for f in FAMILIES}


def hf_config(family: Family) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(family.model_type, **SIZES, **family.options)
    config._attn_implementation = "eager"
    return config


def write_hf_model(directory: Path, family: Family, seed: int = 0) -> torch.nn.Module:
    """A seeded random model of the family, saved as a HF directory (with the tiny tokenizer); returns it, eval."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial norms
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)  # biases are zero at initialisation: make them count
    model.save_pretrained(directory)
    write_tokenizer_files(directory, SIZES["max_position_embeddings"])
    return model


# --- GGUF, as llama.cpp's convert_hf_to_gguf.py writes it -----------------------------------------------------------
def write_gguf(
    path: Path, family: Family, model: torch.nn.Module, quantize: Sequence[gguf.GGMLQuantizationType] = ()
) -> Path:
    """`quantize`: the matrices in these types, taken in turn (stacked parts then mix types, as in real files)."""
    return write_gguf_file(path, family.gguf_arch, lambda w: _metadata(w, family), _tensors(family, model), quantize)


def _tensors(family: Family, model: torch.nn.Module) -> Iterator[tuple[str, np.ndarray]]:
    """The model's tensors as the converter writes them: Gemma's norms as 1 + w, Llama's q/k rows permuted, no tied
    head, and the rotary's scaling factors as tensors of their own."""
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if family.gguf_arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if family.gguf_arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = _llama_cpp_permute(values, SIZES["num_attention_heads"])
        elif family.gguf_arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _llama_cpp_permute(values, SIZES["num_key_value_heads"])
        yield tensor_name(name, family.gguf_arch), values
    if family.name == "llama3":
        yield "rope_freqs.weight", np.array(_llama3_rope_factors(), dtype=np.float32)
    if family.name == "phi3":
        yield "rope_factors_long.weight", np.array(LONGROPE["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(LONGROPE["short_factor"], dtype=np.float32)


def _metadata(w: gguf.GGUFWriter, family: Family) -> None:
    head_dim = family.options.get("head_dim", HEAD_DIM)
    add_sizes(w, {**SIZES, "head_dim": head_dim, "rope_theta": 10_000.0, "sliding_window": family.sliding_window})
    if family.gguf_arch == "gemma2":
        w.add_attn_logit_softcapping(family.options["attn_logit_softcapping"])
        w.add_final_logit_softcapping(family.options["final_logit_softcapping"])
    if family.name == "phi3":  # the converter's longrope metadata
        scale = SIZES["max_position_embeddings"] / LONGROPE_ORIGINAL
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(LONGROPE_ORIGINAL)))
        w.add_rope_scaling_orig_ctx_len(LONGROPE_ORIGINAL)
    meta = tiny_gguf_metadata()
    add_tokenizer(w, meta, [-float(i) for i in range(len(meta["tokenizer.ggml.tokens"]))])


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors() -> list[float]:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): one divisor per frequency."""
    base, factor = LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE["factor"]
    low, high = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    old = LLAMA3_ROPE["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors
