"""GGUF file → ModelConfig + float32 state dict with Hugging Face names and value conventions + tokenizer.

The file is indexed once with gguf_file.py (a fast reader; `gguf.GGUFReader` is slow on a large vocabulary) and
every tensor is dequantised with `gguf.quants.dequantize`. Two llama.cpp conventions are undone so the weights equal a Hugging Face checkpoint's:
- Gemma RMSNorm weights are stored as w + 1 (llama.cpp multiplies by them directly); HF computes x·(1 + w).
- llama.cpp's converter permutes Llama q/k rows for its rotary layout; HF rotates halves.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from tokenmill.model.gguf_linear import GgufWeight, native
from tokenmill.model.loading.gguf_file import GgufTensor, read_gguf_file
from tokenmill.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedModelError
from tokenmill.tokenizer import Tokenizer

# GGUF block tensor → HF layer module path
_GEMMA3_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3_BLOCK = {**_LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PHI3_BLOCK = {  # q/k/v and gate/up fused in the file, as in the checkpoint (ffn_up holds gate then up)
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_STARCODER2_BLOCK = {  # layer norms (weight and bias), a plain MLP
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_BLOCKS = {
    "gemma3": _GEMMA3_BLOCK,
    "gemma2": _GEMMA3_BLOCK,  # without the q/k norms
    "llama": _LLAMA_BLOCK,
    "qwen2": _LLAMA_BLOCK,
    "qwen3": _QWEN3_BLOCK,
    "phi3": _PHI3_BLOCK,
    "starcoder2": _STARCODER2_BLOCK,
}
_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# rotary scaling factors a file holds as tensors: read into ModelConfig.rope, not weights of the model
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


@dataclass
class GgufModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # float32, HF names and conventions
    tokenizer: Tokenizer
    name: str  # general.name


def read_gguf(path: str, progress: bool = True) -> GgufModel:
    with tqdm(desc="converting GGUF", unit="tensor", disable=not progress) as bar:
        bar.set_postfix_str("parsing the file")
        meta, tensors = read_gguf_file(path)
        arch = str(meta.get("general.architecture"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        config = gguf_config(meta, tensors)
        bar.reset(total=len(tensors))
        bar.set_postfix_str("dequantising")
        state_dict = _convert_tensors(tensors, config, bar)
        bar.set_postfix_str("building the tokenizer")
        tokenizer = Tokenizer.from_gguf(meta)
    return GgufModel(config, state_dict, tokenizer, str(meta.get("general.name", "")))


@dataclass
class NativeGguf:
    """A GGUF file as the engine runs it natively: its quantised weights stay the file's blocks (mapped, not read)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # the rest (norms, float weights), HF names and conventions, in `dtype`
    quantized: dict[str, GgufWeight]  # HF weight names → the file's blocks, rows in HF's order
    tokenizer: Future[Tokenizer]  # built on a thread of its own while the caller regroups the weights
    name: str
    mapped: tuple[int, int]  # the address range of the file's tensor data in its (copy-on-write) mapping


def read_gguf_native(path: str, dtype: torch.dtype) -> NativeGguf:
    """Index the file and keep every weight of a type the kernels take as its blocks; no dequantisation, no copy
    (but for Llama's q/k rows, which llama.cpp's converter permuted: their block rows are put back in HF's order)."""
    meta, tensors = read_gguf_file(path, writable=True)
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = gguf_config(meta, tensors)
    tokenizer = _on_its_own_thread(Tokenizer.from_gguf, meta)
    state_dict: dict[str, torch.Tensor] = {}
    quantized: dict[str, GgufWeight] = {}
    for tensor in _weights(tensors):
        name = hf_name(tensor.name, config.architecture)
        weight = GgufWeight(int(tensor.tensor_type), torch.from_numpy(tensor.data), int(tensor.shape[0]))
        if len(tensor.shape) == 2 and name.endswith(".weight") and native(weight):
            rows = _hf_rows(name, weight.raw, config)
            quantized[name] = GgufWeight(weight.ggml_type, rows, weight.k, file_backed=rows is weight.raw)
        else:
            values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            shape = tuple(reversed(tensor.shape))
            state_dict[name] = _to_hf_convention(name, torch.from_numpy(values).reshape(shape), config).to(dtype)
    addresses = [(t.data.ctypes.data, t.data.ctypes.data + t.data.nbytes) for t in tensors]
    mapped = (min(a for a, _ in addresses), max(b for _, b in addresses))
    return NativeGguf(config, state_dict, quantized, tokenizer, str(meta.get("general.name", "")), mapped)


def _on_its_own_thread(build: Callable[[dict[str, Any]], Tokenizer], meta: dict[str, Any]) -> Future[Tokenizer]:
    """build(meta) on a new thread. Why: a large vocabulary's tokenizer takes seconds to build, most of them holding
    the GIL, and the weights' regrouping that follows is one C call that needs none; on two cores the two overlap."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer")
    try:
        return pool.submit(build, meta)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def _hf_rows(name: str, raw: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A quantised weight's block rows in HF's order: Llama's q/k rows un-permuted (a row's blocks move whole)."""
    if config.architecture == "llama" and name.endswith("q_proj.weight"):
        return unpermute_rotary(raw, config.num_heads).contiguous()
    if config.architecture == "llama" and name.endswith("k_proj.weight"):
        return unpermute_rotary(raw, config.num_kv_heads).contiguous()
    return raw


def read_gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of a GGUF file, built from its vocabulary."""
    meta, _ = read_gguf_file(path)
    return Tokenizer.from_gguf(meta)


# --- config ---------------------------------------------------------------------------------------------------------
def gguf_config(meta: dict[str, Any], tensors: list[GgufTensor]) -> ModelConfig:
    """ModelConfig from `<arch>.*` metadata, the tensors present (biases, q/k norms) and the rope factor tensors."""
    arch = str(meta["general.architecture"])
    tensor_shapes = {t.name: tuple(reversed(t.shape)) for t in tensors}

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    common: dict[str, Any] = {  # ModelConfig fields shared by every architecture
        "architecture": arch,
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_layers": int(key("block_count")),
        "num_heads": heads,
        "num_kv_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", key("attention.layer_norm_epsilon"))),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "rope_scaling_factor": _rope_scaling(arch, key("rope.scaling.type"), key("rope.scaling.factor")),
        "name": str(meta.get("general.name", "")),
    }
    if arch in ("gemma3", "gemma2"):
        return _gemma_config(common, key, arch)
    sliding = key("attention.sliding_window")
    layer_types = ("sliding_attention",) * common["num_layers"] if sliding else ()
    return ModelConfig(
        **common,
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rope=_rope_factors({t.name: t for t in tensors}, key),
        sliding_window=sliding,
        layer_types=layer_types,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes or "blk.0.attn_qkv.bias" in tensor_shapes,
        output_bias="blk.0.attn_output.bias" in tensor_shapes,
        mlp_bias="blk.0.ffn_down.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
    )


def _rope_factors(tensors: dict[str, GgufTensor], key: Callable[..., Any]) -> RopeScaling | None:
    """llama.cpp keeps Llama 3's scaling as a `rope_freqs` tensor of divisors, Phi-3's longrope as two
    (`rope_factors_short` / `_long`) with the original context length and attention factor in the metadata."""

    def values(name: str) -> tuple[float, ...]:
        return tuple(float(v) for v in np.asarray(tensors[name].data, dtype=np.float32).ravel())

    if "rope_freqs.weight" in tensors:
        return RopeScaling(values("rope_freqs.weight"))
    if "rope_factors_long.weight" not in tensors:
        return None
    original = int(key("rope.scaling.original_context_length"))
    return RopeScaling(
        divisors=values("rope_factors_short.weight"),
        long_divisors=values("rope_factors_long.weight"),
        original_max_positions=original,
        attention_scale=_f32(key("rope.scaling.attn_factor", 1.0)),
    )


def _weights(tensors: list[GgufTensor]) -> list[GgufTensor]:
    return [t for t in tensors if t.name not in _ROPE_TENSORS]


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def _gemma_config(common: dict[str, Any], key: Callable[..., Any], arch: str) -> ModelConfig:
    layers, hidden, heads = common["num_layers"], common["hidden_size"], common["num_heads"]
    # llama.cpp: the 27B (46 layers in Gemma 2, 62 in Gemma 3) scales queries by hidden/heads, other sizes by head_dim
    scalar = hidden // heads if layers == (62 if arch == "gemma3" else 46) else common["head_dim"]
    if arch == "gemma2":  # sliding and global layers alternate, one rope base, soft-capped scores and logits
        return ModelConfig(
            **common,
            rope_theta=_f32(key("rope.freq_base", 10_000.0)),
            sliding_window=int(key("attention.sliding_window", 4096)),
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)),
            query_pre_attn_scalar=float(scalar),
            attn_logit_softcapping=_optional_f32(key("attn_logit_softcapping")),
            final_logit_softcapping=_optional_f32(key("final_logit_softcapping")),
        )
    return ModelConfig(
        **common,
        rope_theta=_f32(key("rope.freq_base", 1_000_000.0)),
        rope_local_theta=10_000.0,
        sliding_window=int(key("attention.sliding_window", 4096)),
        layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)),
        query_pre_attn_scalar=float(scalar),
    )


def _optional_f32(value: Any) -> float | None:
    return None if value is None else _f32(value)


def _rope_scaling(arch: str, kind: Any, factor: Any) -> float:
    if kind in (None, "none") or factor in (None, 1.0):
        return 1.0
    if kind != "linear":
        raise UnsupportedModelError(f"{arch} GGUF with rope scaling {kind!r} is not supported (only linear)")
    return _f32(factor)


# --- tensors --------------------------------------------------------------------------------------------------------
def hf_name(gguf_name: str, arch: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`."""
    if m := _BLOCK_NAME.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCKS[arch]:
            return f"model.layers.{layer}.{_BLOCKS[arch][part]}.{kind}"
    elif (m := _GLOBAL_NAME.match(gguf_name)) and m.group(1) in _GLOBALS:
        return f"{_GLOBALS[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModelError(f"{arch} GGUF tensor {gguf_name!r} has no place in this engine's model")


def gguf_block_name(module: str, arch: str) -> str:
    """hf_name's inverse for a decoder layer's module: `model.layers.3.self_attn.q_proj` → `blk.3.attn_q`."""
    _, _, layer, local = module.split(".", 3)
    (name,) = [gguf for gguf, hf in _BLOCKS[arch].items() if hf == local]
    return f"blk.{layer}.{name}"


def _convert_tensors(tensors: list[GgufTensor], config: ModelConfig, bar: tqdm) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in _weights(tensors):
        name = hf_name(tensor.name, config.architecture)
        values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = tuple(reversed(tensor.shape))  # ggml lists the fastest dimension first
        state_dict[name] = _to_hf_convention(name, torch.from_numpy(values).reshape(shape), config)
        bar.update()
    return state_dict


def _to_hf_convention(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if config.architecture in ("gemma3", "gemma2") and name.endswith("norm.weight"):
        return weight - 1.0  # stored as w + 1
    if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rotary(weight, config.num_heads)
    if config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rotary(weight, config.num_kv_heads)
    return weight


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs back to HF's two halves per head."""
    rows = weight.shape[0]
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])  # (H, D/2, 2, ...)
    return w.transpose(1, 2).reshape(weight.shape)  # (H, 2, D/2, ...) → (H·D, ...)
