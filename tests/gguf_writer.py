"""A tiny test model written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one: its tensor names, the
model's sizes and the tiny tokenizer as metadata, and the matrices quantised in the given types taken in turn (so the
parts of a stacked projection mix types, as in real files). tiny_model.py (Gemma 3) and model/families.py (every
family) write theirs through it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_BLOCK = {  # a decoder layer's Hugging Face module → llama.cpp's tensor in block N
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate then up, one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.c_fc": "ffn_up",  # StarCoder2
    "mlp.c_proj": "ffn_down",
}
_GEMMA_NORMS = {  # Gemma has a norm after each sublayer too
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.norm.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}


def tensor_name(name: str, arch: str) -> str:
    """A Hugging Face parameter's name in a GGUF file of architecture `arch`."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, *module, kind = name.split(".")
    names = {**_BLOCK, **_GEMMA_NORMS} if arch.startswith("gemma") else _BLOCK
    return f"blk.{layer}.{names['.'.join(module)]}.{kind}"


def add_sizes(w: gguf.GGUFWriter, config: Mapping[str, Any]) -> None:
    """The model's sizes, from a config in Hugging Face's names with its head_dim and rope_theta (and its
    sliding_window, where it has one)."""
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])


def add_tokenizer(w: gguf.GGUFWriter, meta: Mapping[str, Any], scores: Sequence[float]) -> None:
    """A vocabulary given as GGUF metadata (tiny_model.tiny_gguf_metadata), with these scores, and its bos and eos."""
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(list(scores))
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])


def write_gguf_file(
    path: str | Path,
    arch: str,
    metadata: Callable[[gguf.GGUFWriter], None],
    tensors: Iterable[tuple[str, np.ndarray]],
    quantize: Sequence[gguf.GGMLQuantizationType] = (),
) -> Path:
    """A GGUF of architecture `arch` (written as given: tests make files the engine does not support), its metadata
    added by `metadata`, then `tensors` (GGUF names, float32 values) in order: each matrix in the next of the
    `quantize` types where there are any, the rest as they are."""
    writer = gguf.GGUFWriter(str(path), arch)
    metadata(writer)
    types = list(quantize)
    for name, values in tensors:
        if types and values.ndim == 2:
            kind, types = types[0], [*types[1:], types[0]]
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
