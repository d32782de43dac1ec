"""Our Llama/Mistral equals `transformers`' on the same weights; a llama GGUF (q/k permuted by llama.cpp) loads back."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.tiny_model import write_tokenizer_files
from tests.tokenizer.reference import TEXTS, assert_same_as_transformers
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loading.loader import load_model_files

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
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_hf_model(directory: Path, kind: str) -> torch.nn.Module:
    """A seeded random Llama (untied head) or Mistral (tied, sliding window 8), saved as a HF directory."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SIZES, rope_theta=10_000.0, tie_word_embeddings=False)
    else:
        config = transformers.MistralConfig(**SIZES, rope_theta=1e6, sliding_window=8, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial norms
    model.save_pretrained(directory)
    write_tokenizer_files(directory, SIZES["max_position_embeddings"])
    return model


def write_llama_gguf(path: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """As llama.cpp's converter writes it: its names, and q/k rows permuted for its rotary layout."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _metadata(writer)
    for name, tensor in state_dict.items():
        values = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            values = _llama_cpp_permute(values, SIZES["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = _llama_cpp_permute(values, SIZES["num_key_value_heads"])
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in fixed or name == "lm_head.weight":
        return fixed.get(name, "output.weight")
    _, _, layer, *module, kind = name.split(".")
    return f"blk.{layer}.{_GGUF_BLOCK['.'.join(module)]}.{kind}"


def _metadata(w: gguf.GGUFWriter) -> None:
    from tests.tiny_model import tiny_gguf_metadata

    w.add_context_length(SIZES["max_position_embeddings"])
    w.add_embedding_length(SIZES["hidden_size"])
    w.add_block_count(SIZES["num_hidden_layers"])
    w.add_feed_forward_length(SIZES["intermediate_size"])
    w.add_head_count(SIZES["num_attention_heads"])
    w.add_head_count_kv(SIZES["num_key_value_heads"])
    w.add_layer_norm_rms_eps(SIZES["rms_norm_eps"])
    w.add_rope_freq_base(10_000.0)
    meta = tiny_gguf_metadata()
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores([-float(i) for i in range(len(meta["tokenizer.ggml.tokens"]))])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_llama_logits_equal_transformers(kind: str, tmp_path: Path) -> None:
    reference = write_hf_model(tmp_path / kind, kind)
    weights = load_model_files(str(tmp_path / kind), str(tmp_path / "cache"), torch.float32)
    assert weights.config.architecture == "llama"
    assert weights.config.sliding_window == (8 if kind == "mistral" else None)
    ours = LlamaForCausalLM(weights.config)
    ours.load_state_dict(weights.state_dict, strict=True)
    ids = torch.randint(0, SIZES["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]  # (T, V)
    torch.testing.assert_close(ours.eval().forward_dense(ids), expected, atol=1e-4, rtol=0)


def test_llama_gguf_loads_back_to_the_hf_weights(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "hf", "llama")
    hf = load_model_files(str(tmp_path / "hf"), str(tmp_path / "cache"), torch.float32)
    path = write_llama_gguf(tmp_path / "llama.gguf", hf.state_dict)
    loaded = load_model_files(str(path), str(tmp_path / "cache"), torch.float32)
    assert loaded.config.head_dim == 16 and not loaded.config.tie_word_embeddings
    assert loaded.state_dict.keys() == hf.state_dict.keys()
    for name, tensor in hf.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.tokenizer.add_bos and loaded.tokenizer.bos_id == 2


def test_llama_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_hf_model(tmp_path / "hf", "llama")
    hf = load_model_files(str(tmp_path / "hf"), str(tmp_path / "cache"), torch.float32)
    path = write_llama_gguf(tmp_path / "llama.gguf", hf.state_dict)
    ours = load_model_files(str(path), str(tmp_path / "cache"), torch.float32).tokenizer
    assert_same_as_transformers(ours, AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), TEXTS)
