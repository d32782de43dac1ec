"""Hugging Face model directory (config.json + *.safetensors + tokenizer files) → ModelConfig + state dict."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.loading.memory import unmap_file_pages
from tokenmill.model.model_config import ModelConfig, RopeScaling, UnsupportedModelError

# config.json model_type → our architecture (GGUF's name for it)
MODEL_TYPES = {
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma2": "gemma2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "starcoder2": "starcoder2",
}
# prefixes multimodal Gemma 3 checkpoints put before the text model's names
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def read_hf_config(path: Path) -> ModelConfig:
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model architecture {model_type!r} in {path}/config.json; "
            f"supported model_type: {', '.join(MODEL_TYPES)}"
        )
    if model_type == "gemma3":  # multimodal wrapper: the text model's config is nested
        raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **raw.get("text_config", {})}
        model_type = "gemma3_text"
    arch = MODEL_TYPES[model_type]
    common = _common_fields(raw, arch, path.name)
    if arch == "gemma3":
        return _gemma3_config(raw, common)
    return _gemma2_config(raw, common) if arch == "gemma2" else _llama_config(raw, common, model_type)


def _common_fields(raw: dict[str, Any], arch: str, name: str) -> dict[str, Any]:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return {
        "architecture": arch,
        "vocab_size": raw["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": raw["intermediate_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or hidden // heads,
        "rms_norm_eps": float(raw.get("rms_norm_eps", raw.get("norm_epsilon", 1e-6))),
        "max_position_embeddings": raw.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", arch.startswith("gemma"))),
        "name": name,
    }


def _gemma3_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    layers = common["num_layers"]
    pattern = raw.get("sliding_window_pattern", 6)
    default_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    full = _rope_params(raw, "full_attention")
    local = _rope_params(raw, "sliding_attention")
    return ModelConfig(
        **common,
        rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        rope_scaling_factor=_linear_factor(full or raw.get("rope_scaling")),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=tuple(raw.get("layer_types") or default_types),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
    )


def _gemma2_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma 2: sliding and global layers alternating (sliding first), one rope base, soft-capped scores and logits."""
    layers = common["num_layers"]
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    params = _rope_params(raw, None)
    return ModelConfig(
        **common,
        rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        rope_scaling_factor=_linear_factor(params or raw.get("rope_scaling")),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=tuple(raw.get("layer_types") or default_types),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _llama_config(raw: dict[str, Any], common: dict[str, Any], model_type: str) -> ModelConfig:
    """Llama, Mistral, Qwen2, Qwen3 and Phi-3: one decoder with the members' options (llama.py); StarCoder2 shares
    its attention (starcoder2.py), with biases everywhere where `use_bias` (its default)."""
    if raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{model_type} with a partial rotary (partial_rotary_factor) is not supported")
    params = _rope_params(raw, None)
    scaling = params or raw.get("rope_scaling") or {}
    attention_bias = bool(raw.get("attention_bias") or raw.get("use_bias", model_type == "starcoder2"))
    return ModelConfig(
        **common,
        rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        rope_scaling_factor=_linear_factor(scaling),
        rope=_rope_scaling(scaling, raw, common["head_dim"]),
        **_windows(raw, model_type, common["num_layers"]),
        attention_bias=attention_bias or model_type == "qwen2",  # Qwen2's q/k/v always have biases
        output_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias") or (model_type == "starcoder2" and attention_bias)),
        qk_norm=model_type == "qwen3",
    )


def _windows(raw: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """sliding_window and which layers use it: `layer_types` where the config lists them (transformers >= 4.5x
    writes them for Qwen), else every layer (Mistral, Phi-3) or, for Qwen, those from `max_window_layers` on."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return {"sliding_window": None, "layer_types": ()}
    types = raw.get("layer_types")
    if not types and model_type in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": tuple(types or ["sliding_attention"] * layers)}


def _rope_params(raw: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """transformers ≥ 5 writes `rope_parameters` (per layer type for Gemma 3); older configs `rope_scaling`."""
    params = raw.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params if "rope_type" in params or "rope_theta" in params else {}


def _kind(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _linear_factor(scaling: dict[str, Any] | None) -> float:
    kind = _kind(scaling)
    if kind in ("default", "llama3", "longrope", "su"):  # the last three: RopeScaling
        return 1.0
    if kind != "linear":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3, longrope are)")
    return float((scaling or {})["factor"])


def _rope_scaling(scaling: dict[str, Any], raw: dict[str, Any], head_dim: int) -> RopeScaling | None:
    """Llama 3's and Phi-3's per-frequency scaling, as transformers' modeling_rope_utils computes it."""
    kind = _kind(scaling)
    if kind == "llama3":
        return RopeScaling(
            llama3_divisors(scaling, float(scaling.get("rope_theta", raw.get("rope_theta", 10_000.0))), head_dim)
        )
    if kind not in ("longrope", "su"):
        return None
    original = int(scaling.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
    factor = scaling.get("factor") or raw["max_position_embeddings"] / original
    attention_scale = scaling.get("attention_factor")
    if attention_scale is None:
        attention_scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        divisors=tuple(float(f) for f in scaling["short_factor"]),
        long_divisors=tuple(float(f) for f in scaling["long_factor"]),
        original_max_positions=original,
        attention_scale=float(attention_scale),
    )


def llama3_divisors(scaling: dict[str, Any], base: float, head_dim: int) -> tuple[float, ...]:
    """Llama 3's scaling as a divisor per frequency: long wavelengths slowed by `factor`, short ones kept, those
    between blended smoothly (transformers' `_compute_llama3_parameters`)."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


class Checkpoint:
    """A directory's safetensors files, memory-mapped: each tensor a view of the file's pages, read when first used.

    Why not safetensors' `safe_open(...).get_tensor`: it copies each tensor out of the file, so a whole checkpoint read
    that way is all in memory at once before any of it is converted. A view costs nothing until it is read, and
    `release` hands its pages back once the tensor has been converted (they stay in the page cache), so loading holds
    about one layer of the checkpoint at a time. Names are the text model's (multimodal prefixes mapped, vision
    towers left out); a tied head's checkpoint copy is left out too.
    """

    def __init__(self, path: Path, config: ModelConfig) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors weights")
        self._entries: dict[str, tuple[mmap.mmap, torch.dtype, list[int], int]] = {}
        for file in files:
            with file.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
                # private and never written: its pages are the page cache's until released (see unmap_file_pages)
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if file.stat().st_size else None
            for key, info in header.items():
                name = None if key == "__metadata__" else _text_model_name(key)
                if name is None or (config.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise UnsupportedModelError(
                        f"{file.name}: tensor {key} is {info['dtype']}, not one of {', '.join(SAFETENSORS_DTYPES)}"
                    )
                assert mapped is not None
                begin = 8 + header_len + info["data_offsets"][0]
                self._entries[name] = (mapped, SAFETENSORS_DTYPES[info["dtype"]], info["shape"], begin)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def view(self, name: str) -> torch.Tensor:
        """The tensor as the file holds it, without a copy: convert (copy) it before releasing it."""
        mapped, dtype, shape, begin = self._entries[name]
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=begin).view(shape)

    def release(self, name: str) -> None:
        """This tensor's pages leave the process (they stay in the page cache); its views must not be read again."""
        tensor = self.view(name)
        if tensor.numel():
            unmap_file_pages(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())

    def take(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A copy of the tensor in `dtype` (aligned, in this process's own memory); the file's pages released."""
        tensor = self.view(name).to(dtype, copy=True)
        self.release(name)
        return tensor


def read_hf_state_dict(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `dtype`, one at a time (the unquantised paths keep them all)."""
    checkpoint = Checkpoint(path, config)
    return {name: checkpoint.take(name, dtype) for name in checkpoint.names()}


def _text_model_name(key: str) -> str | None:
    if key.startswith(_SKIPPED):
        return None
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old) :]
    return key
