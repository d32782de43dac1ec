"""What every architecture shares (model/causal_lm.py): here, the bytes of weights one decode step reads, and the C
kernels its forward calls."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.engine.tiny import tiny_config, tiny_model
from tokenmill.kernels import ops
from tokenmill.model.causal_lm import KernelReport
from tokenmill.model.linear import prepare_linears
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_tied_table_is_read_once_as_the_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.float32)
    model = build_model(weights.config, weights.state_dict)
    assert model.lm_head is None
    assert model.weight_bytes_per_token() == nbytes(list(model.parameters())) > 0  # the table among them, once


def test_a_quantised_head_is_counted_in_its_own_bytes_and_the_table_is_gone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = load_model_files(str(tiny_model_dir), str(tmp_path), torch.bfloat16)
    model = build_model(weights.config, weights.state_dict)
    full = model.weight_bytes_per_token()
    prepare_linears(model, "int8")
    state = model.state_dict()
    assert not any(k.startswith("model.embed_tokens.") for k in state)  # lookups read the int8 head's rows
    assert model.weight_bytes_per_token() == nbytes(list(state.values())) < full


def test_a_separate_heads_embedding_table_is_only_looked_up() -> None:
    cfg = dataclasses.replace(tiny_config(), architecture="llama", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    table = model.model.embed_tokens.weight
    assert model.lm_head is not None
    assert model.weight_bytes_per_token() == nbytes(list(model.parameters())) - nbytes([table])


def test_a_model_reports_the_c_kernels_its_forward_calls() -> None:
    llama = LlamaForCausalLM(dataclasses.replace(tiny_config(), architecture="llama")).to(torch.bfloat16)
    gemma = tiny_model().to(torch.bfloat16)
    assert llama.c_kernels(torch.float32) == KernelReport((), decoder_layer=False)  # bf16 activations only
    in_c = ops.library() is not None
    assert ("silu_mul" in llama.c_kernels(torch.bfloat16).modules) == (in_c and ops.silu_mul_available())
    assert ("gelu_mul" in gemma.c_kernels(torch.bfloat16).modules) == (in_c and ops.gelu_mul_available())
    assert "gelu_mul" not in llama.c_kernels(torch.bfloat16).modules
    assert not {"gguf_matmul", "int8_matmul"} & set(gemma.c_kernels(torch.bfloat16).modules)  # its linears: torch's
    assert not gemma.c_kernels(torch.bfloat16).decoder_layer  # the C layer takes GGUF blocks only
