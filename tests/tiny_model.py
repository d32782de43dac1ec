"""A tiny random-weight Gemma 3 written as a Hugging Face directory (and as GGUF files) for the fast test tier.

The tokenizer is Gemma-shaped (▁ for spaces, byte fallback, merges in vocabulary order, control tokens), small enough
to build in milliseconds; `transformers` loads the directory too (Gemma3ForCausalLM + AutoTokenizer), so tests can
compare against it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import save_file

from tests.gguf_writer import add_sizes, add_tokenizer, tensor_name, write_gguf_file
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.fim import FimStyle
from tokenmill.tokenizer.gguf import build_gguf_tokenizer

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
_PIECES = ["\n", "\n\n", "▁", "▁▁", "▁▁▁▁", "\t"] + [chr(c) for c in range(33, 127)]
_WORDS = ["the", "of", "and", "to", "in", "is", "capital", "France", "Paris", "def", "return", "hello", "world"]
VOCAB_PAD = 512  # round the vocabulary up with <unusedN> control tokens


def tiny_vocab() -> tuple[list[str], list[int]]:
    """GGUF-style (tokens, llama.cpp token types): control, then bytes, then pieces whose merges follow their order."""
    tokens, types = list(CONTROL), [3] * len(CONTROL)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words = [p for w in _WORDS for p in _prefixes("▁" + w)] + [p for w in _WORDS for p in _prefixes(w)]
    for piece in _PIECES + words:
        if piece not in tokens:
            tokens.append(piece)
            types.append(4 if piece in ("\n", "\n\n", "\t") else 1)
    while len(tokens) < VOCAB_PAD:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(3)
    return tokens, types


def _prefixes(word: str) -> list[str]:
    return [word[:n] for n in range(2, len(word) + 1)]


def tiny_gguf_metadata() -> dict[str, Any]:
    tokens, types = tiny_vocab()
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(*build_gguf_tokenizer(tiny_gguf_metadata()))


def tiny_hf_config() -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB_PAD,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        "sliding_window": 8,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def tiny_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF names; linear weights ~ 1/sqrt(fan_in) so activations stay O(1); norms (used as 1 + w) near zero."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    sd = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden, std=0.5)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * hd, hidden),
            "self_attn.k_proj": (kv * hd, hidden),
            "self_attn.v_proj": (kv * hd, hidden),
            "self_attn.o_proj": (hidden, heads * hd),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        for name, (rows, cols) in shapes.items():
            sd[p + name + ".weight"] = rand(rows, cols, std=cols**-0.5)
        for norm, dim in (
            ("input_layernorm", hidden),
            ("post_attention_layernorm", hidden),
            ("pre_feedforward_layernorm", hidden),
            ("post_feedforward_layernorm", hidden),
            ("self_attn.q_norm", hd),
            ("self_attn.k_norm", hd),
        ):
            sd[p + norm + ".weight"] = rand(dim, std=0.1)
    sd["model.norm.weight"] = rand(hidden, std=0.1)
    return sd


def write_tiny_model(directory: str | Path, seed: int = 0, max_position_embeddings: int | None = None) -> Path:
    """config.json, model.safetensors, tokenizer.json + tokenizer/generation configs; a longer context than the
    usual 256 tokens where a test needs completions that run for a while."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config()
    if max_position_embeddings is not None:
        config["max_position_embeddings"] = max_position_embeddings
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tiny_state_dict(config, seed), str(directory / "model.safetensors"))
    write_tokenizer_files(directory, config["max_position_embeddings"])
    return directory


def write_tokenizer_files(directory: Path, max_length: int, tokenizer: Tokenizer | None = None) -> None:
    """The tiny tokenizer (or a variant of it) as tokenizer.json + tokenizer_config.json + generation_config.json."""
    (tokenizer or tiny_tokenizer()).backend.save(str(directory / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    gen_config = {"bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0}
    (directory / "generation_config.json").write_text(json.dumps(gen_config, indent=1))


def write_tiny_gguf(
    path: str | Path,
    architecture: str = "gemma3",
    quantize: bool | Sequence[gguf.GGMLQuantizationType] = False,
    seed: int = 0,
    max_position_embeddings: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """The tiny model as a GGUF (gguf_writer.py); norms stored as w + 1 like llama.cpp does. `architecture` is written
    as given, so tests can make files of architectures the engine does not support. `quantize`: the matrices in Q8_0,
    or in the given types taken in turn. `max_position_embeddings` and `sliding_window` in place of 256 and 8 (a
    GGUF's four Gemma 3 layers are all sliding-window ones)."""
    types = [gguf.GGMLQuantizationType.Q8_0] if quantize is True else list(quantize or [])
    config = tiny_hf_config()
    if max_position_embeddings is not None:
        config["max_position_embeddings"] = max_position_embeddings
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
    tensors = (
        (tensor_name(name, "gemma3"), (tensor + 1.0 if name.endswith("norm.weight") else tensor).numpy())
        for name, tensor in tiny_state_dict(config, seed).items()
    )
    return write_gguf_file(path, architecture, lambda w: _gguf_metadata(w, config), tensors, types)


def _gguf_metadata(w: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    w.add_name("tiny gemma")
    add_sizes(w, config)
    meta = tiny_gguf_metadata()
    add_tokenizer(w, meta, meta["tokenizer.ggml.scores"])
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def tiny_fim_tokenizer(style: FimStyle) -> Tokenizer:
    """The tiny tokenizer with a code model's fill-in-the-middle tokens in place of its last <unusedN> slots (control
    tokens, as real vocabularies hold them), so the vocabulary keeps the tiny models' size."""
    meta = tiny_gguf_metadata()
    names = [style.prefix, style.suffix, style.middle, *style.ends]
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[len(tokens) - len(names) :] = names
    return Tokenizer(*build_gguf_tokenizer({**meta, "tokenizer.ggml.tokens": tokens}))
